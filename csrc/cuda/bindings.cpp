// Python binding of megaft._cuda: checks tensors (dtype, device, contiguity, shape),
// turns them into pointers plus the current stream, and calls the C ABI of
// megaft_cuda.h. All torch-specific code of the CUDA extension lives here, so the
// .cu files stay plain CUDA C++ (apex's split of csrc/ into kernels and a binding).
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "megaft_cuda.h"

namespace {

void check_operand(const at::Tensor& t, const char* name, const at::Tensor& param) {
  TORCH_CHECK(t.defined(), "adamw_step_: ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), "adamw_step_ (megaft._cuda): ", name,
              " must be a CUDA tensor, got device ", t.device(),
              "; use backend='cpu' for CPU tensors");
  TORCH_CHECK(t.device() == param.device(), "adamw_step_: ", name, " is on ",
              t.device(), " but param is on ", param.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "adamw_step_: ", name,
              " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "adamw_step_: ", name,
              " must be contiguous (a flat buffer); call .contiguous() first");
  TORCH_CHECK(t.sizes() == param.sizes(), "adamw_step_: ", name, " has shape ",
              t.sizes(), " but param has shape ", param.sizes());
}

void adamw_step_(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                 at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1,
                 double beta2, double eps, double weight_decay) {
  TORCH_CHECK(param.defined(), "adamw_step_: param is undefined");
  check_operand(param, "param", param);
  check_operand(grad, "grad", param);
  check_operand(exp_avg, "exp_avg", param);
  check_operand(exp_avg_sq, "exp_avg_sq", param);
  const void* ptrs[4] = {param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                         exp_avg_sq.data_ptr()};
  for (int i = 0; i < 4; ++i)
    for (int j = i + 1; j < 4; ++j)
      TORCH_CHECK(param.numel() == 0 || ptrs[i] != ptrs[j],
                  "adamw_step_: param, grad, exp_avg and exp_avg_sq must be four "
                  "distinct buffers (two of them share memory)");
  TORCH_CHECK(step >= 1, "adamw_step_: step counts from 1, got ", step);
  TORCH_CHECK(lr >= 0.0 && eps >= 0.0 && weight_decay >= 0.0,
              "adamw_step_: lr, eps and weight_decay must be >= 0, got ", lr, ", ", eps,
              ", ", weight_decay);
  TORCH_CHECK(0.0 <= beta1 && beta1 < 1.0 && 0.0 <= beta2 && beta2 < 1.0,
              "adamw_step_: betas must be in [0, 1), got ", beta1, ", ", beta2);

  // Launch on param's device and the stream torch is using there, so the step is
  // ordered after the backward pass that produced grad.
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(param.device().index()).stream();
  const int err = megaft_adamw_fp32(
      param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
      exp_avg_sq.data_ptr<float>(), param.numel(), step, lr, beta1, beta2, eps,
      weight_decay, stream);
  TORCH_CHECK(err == 0, "megaft_adamw_fp32 failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megaft CUDA kernels (plain CUDA C++ in csrc/cuda/*.cu behind a C ABI)";
  m.def("adamw_step_", &adamw_step_,
        "In-place fused AdamW step over contiguous float32 CUDA tensors of one shape "
        "on the current stream; step counts from 1. Same math as megaft._C.",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"),
        py::call_guard<py::gil_scoped_release>());
}
