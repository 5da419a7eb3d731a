// Python binding of megaft._C, the C++ CPU ops (always built). Kernels live in
// their own files; this one only declares them to pybind11 and releases the GIL,
// so an offloaded optimizer step can overlap with Python work (apex-style).
#include <torch/extension.h>

#include <string>

namespace megaft::cpu {
void adamw_step_(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                 at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1,
                 double beta2, double eps, double weight_decay);
std::string build_info();
}  // namespace megaft::cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megaft C++ CPU kernels (see megaft/kernels/ for the Python fronts)";
  m.def("adamw_step_", &megaft::cpu::adamw_step_,
        "In-place fused AdamW step (decoupled weight decay, bias correction) over "
        "contiguous float32 CPU tensors of one shape; step counts from 1. Matches "
        "torch.optim.AdamW(foreach=False) to fp32 rounding.",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"),
        py::call_guard<py::gil_scoped_release>());
  m.def("build_info", &megaft::cpu::build_info,
        "One line: SIMD clones and threading this build uses.");
}
