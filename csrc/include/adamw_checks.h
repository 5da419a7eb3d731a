// Argument checks shared by the torch bindings of the AdamW kernels (megaft._C and
// megaft._cuda): one place for the messages users see, whichever backend they call.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace megaft {

// `ext` names the extension in messages; `cuda` says which device it accepts.
inline void check_adamw_operand(const at::Tensor& t, const char* name, const at::Tensor& param,
                                bool cuda, const char* ext) {
  TORCH_CHECK(t.defined(), "adamw_step_: ", name, " is undefined");
  TORCH_CHECK(t.is_cuda() == cuda, "adamw_step_ (", ext, "): ", name, " must be a ",
              cuda ? "CUDA" : "CPU", " tensor, got device ", t.device(), "; use backend='",
              cuda ? "cpu" : "cuda", "' for ", cuda ? "CPU" : "CUDA", " tensors");
  TORCH_CHECK(t.device() == param.device(), "adamw_step_: ", name, " is on ", t.device(),
              " but param is on ", param.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "adamw_step_: ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "adamw_step_: ", name,
              " must be contiguous (a flat buffer); call .contiguous() first");
  TORCH_CHECK(t.sizes() == param.sizes(), "adamw_step_: ", name, " has shape ", t.sizes(),
              " but param has shape ", param.sizes());
}

inline void check_adamw_args(const at::Tensor& param, const at::Tensor& grad,
                             const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                             int64_t step, double lr, double beta1, double beta2, double eps,
                             double weight_decay, bool cuda, const char* ext) {
  TORCH_CHECK(param.defined(), "adamw_step_: param is undefined");
  check_adamw_operand(param, "param", param, cuda, ext);
  check_adamw_operand(grad, "grad", param, cuda, ext);
  check_adamw_operand(exp_avg, "exp_avg", param, cuda, ext);
  check_adamw_operand(exp_avg_sq, "exp_avg_sq", param, cuda, ext);
  const void* ptrs[4] = {param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                         exp_avg_sq.data_ptr()};
  for (int i = 0; i < 4; ++i)
    for (int j = i + 1; j < 4; ++j)
      TORCH_CHECK(param.numel() == 0 || ptrs[i] != ptrs[j],
                  "adamw_step_: param, grad, exp_avg and exp_avg_sq must be four "
                  "distinct buffers (two of them share memory)");
  TORCH_CHECK(step >= 1, "adamw_step_: step counts from 1, got ", step);
  TORCH_CHECK(lr >= 0.0 && eps >= 0.0 && weight_decay >= 0.0,
              "adamw_step_: lr, eps and weight_decay must be >= 0, got ", lr, ", ", eps, ", ",
              weight_decay);
  TORCH_CHECK(0.0 <= beta1 && beta1 < 1.0 && 0.0 <= beta2 && beta2 < 1.0,
              "adamw_step_: betas must be in [0, 1), got ", beta1, ", ", beta2);
}

}  // namespace megaft
