// Python binding of megaft._cuda: checks tensors (dtype, device, contiguity, shape),
// turns them into pointers plus the current stream, and calls the C ABI of
// megaft_cuda.h. All torch-specific code of the CUDA extension lives here, so the
// .cu files stay plain CUDA C++ (apex's split of csrc/ into kernels and a binding).
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

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
