// Python binding of megaft._cuda: checks tensors (dtype, device, contiguity, shape),
// turns them into pointers plus the current stream, and calls the C ABI of
// megaft_cuda.h. All torch-specific code of the CUDA extension lives here, so the
// .cu files stay plain CUDA C++ (apex's split of csrc/ into kernels and a binding).
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <utility>
#include <vector>

#include "adamw_checks.h"
#include "megaft_cuda.h"

namespace {

void adamw_step_(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                 at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1,
                 double beta2, double eps, double weight_decay) {
  megaft::check_adamw_args(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                           weight_decay, /*cuda=*/true, "megaft._cuda");

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

int dtype_code(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? MEGAFT_ADAMW_BF16 : MEGAFT_ADAMW_FP32;
}

// The Python front (megaft/kernels/adamw/tensor_lists.py) checks the lists with
// messages that name the fix; these checks keep a direct call memory-safe.
void check_multi_tensor_args(const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& grads,
                             const std::vector<at::Tensor>& exp_avgs,
                             const std::vector<at::Tensor>& exp_avg_sqs,
                             const std::vector<at::Tensor>& masters,
                             const std::vector<int64_t>& steps, const std::vector<double>& lrs,
                             const std::vector<double>& wds) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  (masters.empty() || masters.size() == n) && steps.size() == n &&
                  lrs.size() == n && wds.size() == n,
              "adamw_multi_tensor_: every list needs one entry per param (", n, ")");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.is_cuda() && p.device() == params[0].device() && p.is_contiguous(),
                "adamw_multi_tensor_: params[", i, "] must be contiguous on ", params[0].device());
    TORCH_CHECK(p.scalar_type() == at::kFloat ||
                    (p.scalar_type() == at::kBFloat16 && !masters.empty()),
                "adamw_multi_tensor_: params[", i, "] is ", p.scalar_type(),
                "; need float32, or bfloat16 with float32 master_params");
    TORCH_CHECK(grads[i].scalar_type() == at::kFloat || grads[i].scalar_type() == at::kBFloat16,
                "adamw_multi_tensor_: grads[", i, "] must be float32 or bfloat16");
    std::vector<const at::Tensor*> fp32 = {&exp_avgs[i], &exp_avg_sqs[i]};
    if (!masters.empty()) fp32.push_back(&masters[i]);
    for (const at::Tensor* t : fp32)
      TORCH_CHECK(t->scalar_type() == at::kFloat, "adamw_multi_tensor_: moments and masters "
                  "must be float32 (tensor ", i, ")");
    fp32.push_back(&grads[i]);
    for (const at::Tensor* t : fp32)
      TORCH_CHECK(t->device() == p.device() && t->is_contiguous() && t->numel() == p.numel(),
                  "adamw_multi_tensor_: tensor ", i, " of every list must be contiguous on ",
                  p.device(), " with ", p.numel(), " elements");
    TORCH_CHECK(steps[i] >= 1, "adamw_multi_tensor_: step counts from 1, got ", steps[i]);
  }
}

void adamw_multi_tensor_(const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& exp_avgs,
                         const std::vector<at::Tensor>& exp_avg_sqs,
                         const std::vector<at::Tensor>& masters, const std::vector<int64_t>& steps,
                         const std::vector<double>& lrs, const std::vector<double>& wds,
                         double beta1, double beta2, double eps) {
  check_multi_tensor_args(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lrs, wds);
  TORCH_CHECK(0.0 <= beta1 && beta1 < 1.0 && 0.0 <= beta2 && beta2 < 1.0,
              "adamw_multi_tensor_: betas must be in [0, 1), got ", beta1, ", ", beta2);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(params[0].device().index()).stream();
  // One C call per (param dtype, grad dtype): each is a single template instance.
  std::map<std::pair<int, int>, std::vector<size_t>> groups;
  for (size_t i = 0; i < params.size(); ++i)
    groups[{dtype_code(params[i]), dtype_code(grads[i])}].push_back(i);
  for (const auto& [dtypes, idx] : groups) {
    std::vector<void*> p;
    std::vector<const void*> g;
    std::vector<float*> m, v, w;
    std::vector<int64_t> n, st;
    std::vector<double> lr, wd;
    for (size_t i : idx) {
      p.push_back(params[i].data_ptr());
      g.push_back(grads[i].data_ptr());
      m.push_back(exp_avgs[i].data_ptr<float>());
      v.push_back(exp_avg_sqs[i].data_ptr<float>());
      if (!masters.empty()) w.push_back(masters[i].data_ptr<float>());
      n.push_back(params[i].numel());
      st.push_back(steps[i]);
      lr.push_back(lrs[i]);
      wd.push_back(wds[i]);
    }
    const int err = megaft_adamw_multi_tensor(
        static_cast<int64_t>(idx.size()), p.data(), g.data(), m.data(), v.data(),
        masters.empty() ? nullptr : w.data(), n.data(), st.data(), lr.data(), wd.data(), beta1,
        beta2, eps, dtypes.first, dtypes.second, stream);
    TORCH_CHECK(err == 0, "megaft_adamw_multi_tensor failed: ",
                cudaGetErrorString(static_cast<cudaError_t>(err)));
  }
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
  m.def("adamw_multi_tensor_", &adamw_multi_tensor_,
        "In-place fused AdamW step over lists of contiguous CUDA tensors of any sizes: "
        "params float32, or bfloat16 with float32 master_params (empty list: none); grads "
        "float32 or bfloat16; moments float32; per-tensor step, lr and weight_decay. Few "
        "launches for the whole list (multi_tensor_apply), on the current stream.",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("master_params"), py::arg("steps"), py::arg("lrs"), py::arg("weight_decays"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
}
