// torch.ops.megaft.{rmsnorm,swiglu,rope,cross_entropy,linear}_* and wgrad_accumulate: the
// torch side of the fused model kernels.
// Checks the tensors (device, dtype, shape, contiguity), allocates the outputs and
// calls the C ABI of megaft_kernels.h on the current stream. Registered as a library
// fragment (the AdamW pybind module is csrc/cuda/bindings.cpp); autograd lives in
// Python (megaft/kernels/<op>/cuda.py), so only CUDA implementations are registered.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "megaft_kernels.h"

// torch's per-thread, per-device cuBLAS and cuBLASLt handles (setup = true: torch sets
// the handle's stream and workspace) and its cuBLASLt workspace (pointer, size). Declared
// here rather than via ATen/cuda/CUDAContextLight.h, which pulls in the cuSPARSE and cuSOLVER headers;
// the signatures must be torch's exactly (the C++ mangling holds the parameter list:
// getCurrentCUDABlasHandle() without `bool` is a symbol torch 2.13 does not export), which
// tests/test_csrc_compile.py checks by compiling this file together with torch's header.
// The types are cublasHandle_t = struct cublasContext*, cublasLtHandle_t = struct cublasLtContext*.
namespace at::cuda {
cublasContext* getCurrentCUDABlasHandle(bool setup);
cublasLtContext* getCurrentCUDABlasLtHandle();
size_t getCUDABlasLtWorkspaceSize();
void* getCUDABlasLtWorkspace();
}  // namespace at::cuda

namespace {

megaft_dtype code_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return MEGAFT_F32;
    case at::kHalf: return MEGAFT_F16;
    case at::kBFloat16: return MEGAFT_BF16;
    default: TORCH_CHECK(false, "megaft: ", name, " must be float32, float16 or bfloat16, got ",
                         t.scalar_type());
  }
}

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "megaft: ", name,
              " must be a CUDA tensor on ", like.device(), ", got ", t.device());
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

void check_launch(int err, const char* what) {
  TORCH_CHECK(err == 0, what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// (y, h, rstd); h is empty without a residual.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                           const std::optional<at::Tensor>& residual,
                                                           double eps) {
  check_cuda(x, x, "x");
  check_cuda(weight, x, "weight");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "megaft.rmsnorm_fwd: weight shape ",
              weight.sizes(), " does not match hidden size ", n);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor x2 = x.contiguous(), w = weight.contiguous();
  at::Tensor r2, h;
  if (residual.has_value()) {
    check_cuda(*residual, x, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "megaft.rmsnorm_fwd: residual must match x in shape and dtype");
    r2 = residual->contiguous();
    h = at::empty_like(x2);
  } else {
    h = at::empty({0}, x.options());
  }
  const int64_t rows = n ? x2.numel() / n : 0;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::promote_types(x.scalar_type(), w.scalar_type())));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  check_launch(megaft_rmsnorm_fwd(x2.data_ptr(), r2.defined() ? r2.data_ptr() : nullptr, w.data_ptr(),
                                  y.data_ptr(), r2.defined() ? h.data_ptr() : nullptr,
                                  rstd.data_ptr<float>(), rows, n, eps, code_of(x, "x"),
                                  code_of(w, "weight"), code_of(y, "y"), stream_of(x)),
               "megaft_rmsnorm_fwd");
  return {y, h, rstd};
}

// (dx, dweight); x is the normalized input (h when fused); dh is added to dx.
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                               const at::Tensor& weight, const at::Tensor& rstd,
                                               const std::optional<at::Tensor>& dh) {
  for (const auto& [t, name] : {std::pair{dy, "dy"}, {weight, "weight"}, {rstd, "rstd"}}) check_cuda(t, x, name);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(dy.sizes() == x.sizes() && rstd.numel() == rows && rstd.scalar_type() == at::kFloat,
              "megaft.rmsnorm_bwd: dy/rstd do not fit x");
  const at::Tensor x2 = x.contiguous(), dy2 = dy.contiguous(), w = weight.contiguous();
  at::Tensor dh2;
  if (dh.has_value()) {
    check_cuda(*dh, x, "dh");
    TORCH_CHECK(dh->sizes() == x.sizes() && dh->scalar_type() == x.scalar_type(), "megaft.rmsnorm_bwd: dh must match x");
    dh2 = dh->contiguous();
  }
  // Enough partial-dw rows to fill the GPU, few enough that summing them is cheap.
  int sms = 0;
  check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index()),
               "cudaDeviceGetAttribute");
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 4 * sms)));
  at::Tensor dx = at::empty_like(x2);
  at::Tensor dw_part = at::empty({parts, n}, x.options().dtype(at::kFloat));
  check_launch(megaft_rmsnorm_bwd(dy2.data_ptr(), x2.data_ptr(), w.data_ptr(), rstd.data_ptr<float>(),
                                  dh2.defined() ? dh2.data_ptr() : nullptr, dx.data_ptr(),
                                  dw_part.data_ptr<float>(), rows, n, parts, code_of(x, "x"),
                                  code_of(w, "weight"), code_of(dy, "dy"), stream_of(x)),
               "megaft_rmsnorm_bwd");
  at::Tensor dw = rows ? dw_part.sum(0).to(weight.scalar_type()) : at::zeros_like(weight);
  return {dx.view(x.sizes()), dw};
}

void check_pair(const at::Tensor& a, const at::Tensor& b, const char* what) {
  check_cuda(a, a, what);
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && a.device() == b.device(),
              "megaft.", what, ": gate and up (and dy) must match in shape, dtype and device");
}

at::Tensor swiglu_fwd(const at::Tensor& gate, const at::Tensor& up) {
  check_pair(gate, up, "swiglu_fwd");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::empty_like(g);
  check_launch(megaft_swiglu_fwd(g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel(), code_of(g, "gate"),
                                 stream_of(g)),
               "megaft_swiglu_fwd");
  return y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_bwd(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up) {
  check_pair(gate, up, "swiglu_bwd");
  check_pair(dy, gate, "swiglu_bwd");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor d = dy.contiguous(), g = gate.contiguous(), u = up.contiguous();
  at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
  check_launch(megaft_swiglu_bwd(d.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(), du.data_ptr(),
                                 g.numel(), code_of(g, "gate"), stream_of(g)),
               "megaft_swiglu_bwd");
  return {dg, du};
}

at::Tensor rope_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  const at::Tensor xc = x.stride(-1) == 1 ? x : x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t xs[3] = {xc.stride(0), xc.stride(1), xc.stride(2)};
  const int64_t ys[3] = {y.stride(0), y.stride(1), y.stride(2)};
  check_launch(megaft_rope(xc.data_ptr(), y.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                           xc.size(0), xc.size(1), xc.size(2), xc.size(3), xs, ys, cos.stride(0),
                           backward ? 1 : 0, code_of(xc, "q/k"), stream_of(xc)),
               "megaft_rope");
  return y;
}

// (rope(q), rope(k)), or the rotation by -angle (the gradient) with backward.
std::tuple<at::Tensor, at::Tensor> rope_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                            const at::Tensor& sin, bool backward) {
  check_cuda(q, q, "q");
  check_cuda(k, q, "k");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  k.size(3) == q.size(3) && k.scalar_type() == q.scalar_type(),
              "megaft.rope_fwd: q [batch, heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim] "
              "must agree, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.size(3) % 2 == 0, "megaft.rope_fwd: head_dim must be even, got ", q.size(3));
  const at::IntArrayRef table{q.size(2), q.size(3)};
  TORCH_CHECK(cos.sizes() == table && sin.sizes() == table, "megaft.rope_fwd: cos/sin must be [seq, head_dim]");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor c = cos.to(q.device(), at::kFloat).contiguous(), s = sin.to(q.device(), at::kFloat).contiguous();
  return {rope_one(q, c, s, backward), rope_one(k, c, s, backward)};
}

constexpr int64_t kIgnoreIndex = -100;  // megaft.layers.cross_entropy.IGNORE_INDEX

void check_ce_rows(const at::Tensor& logits, const at::Tensor& labels, int64_t n_real, const char* what) {
  check_cuda(logits, logits, "logits");
  check_cuda(labels, logits, "labels");
  TORCH_CHECK(logits.dim() == 2, what, ": logits must be [tokens, local_vocab], got ", logits.sizes());
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0) && labels.scalar_type() == at::kLong,
              what, ": labels must be int64 [", logits.size(0), "], got ", labels.scalar_type(), " ",
              labels.sizes());
  TORCH_CHECK(n_real >= 0 && n_real <= logits.size(1), what, ": n_real=", n_real, " must be in [0, ",
              logits.size(1), "]");
}

// (m, s, t) per row, fp32: max, sum of exp(x - max) over the n_real real columns, and
// the label's logit when it is in this slice (else 0). Combined over tp in Python.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_fwd(const at::Tensor& logits, const at::Tensor& labels,
                                                                 int64_t vocab_start, int64_t n_real) {
  check_ce_rows(logits, labels, n_real, "megaft.cross_entropy_fwd");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const at::Tensor y = labels.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor m = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor s = at::empty_like(m), t = at::empty_like(m);
  check_launch(megaft_cross_entropy_fwd(x.data_ptr(), y.data_ptr<int64_t>(), m.data_ptr<float>(),
                                        s.data_ptr<float>(), t.data_ptr<float>(), rows, n_real, x.stride(0),
                                        vocab_start, kIgnoreIndex, code_of(x, "logits"), stream_of(x)),
               "megaft_cross_entropy_fwd");
  return {m, s, t};
}

void launch_ce_bwd(const at::Tensor& x, const at::Tensor& labels, const at::Tensor& lse, const at::Tensor& g,
                   const at::Tensor& dx, int64_t vocab_start, int64_t n_real) {
  const int64_t rows = x.size(0);
  for (const auto& [v, name] : {std::pair{lse, "lse"}, {g, "g"}}) {
    check_cuda(v, x, name);
    TORCH_CHECK(v.dim() == 1 && v.size(0) == rows && v.scalar_type() == at::kFloat,
                "megaft.cross_entropy_bwd: ", name, " must be float32 [", rows, "]");
  }
  const at::Tensor y = labels.contiguous(), l = lse.contiguous(), gc = g.contiguous();
  check_launch(megaft_cross_entropy_bwd(x.data_ptr(), y.data_ptr<int64_t>(), l.data_ptr<float>(),
                                        gc.data_ptr<float>(), dx.data_ptr(), rows, x.size(1), n_real,
                                        x.stride(0), dx.stride(0), vocab_start, code_of(x, "logits"),
                                        stream_of(x)),
               "megaft_cross_entropy_bwd");
}

// grad_logits = g * (softmax - onehot) in a new tensor of the logits' type.
at::Tensor cross_entropy_bwd(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                             const at::Tensor& g, int64_t vocab_start, int64_t n_real) {
  check_ce_rows(logits, labels, n_real, "megaft.cross_entropy_bwd");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  at::Tensor dx = at::empty({x.size(0), x.size(1)}, x.options());
  launch_ce_bwd(x, labels, lse, g, dx, vocab_start, n_real);
  return dx;
}

// The same, written over the logits (which the caller no longer needs).
at::Tensor cross_entropy_bwd_(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                              const at::Tensor& g, int64_t vocab_start, int64_t n_real) {
  check_ce_rows(logits, labels, n_real, "megaft.cross_entropy_bwd_");
  TORCH_CHECK(logits.stride(1) == 1, "megaft.cross_entropy_bwd_: in-place logits need a unit column stride");
  const c10::cuda::CUDAGuard guard(logits.device());
  launch_ce_bwd(logits, labels, lse, g, logits, vocab_start, n_real);
  return logits;
}

// main_grad [N, K] += dy[M, N]^T @ x[M, K]: one cublasGemmEx with beta = 1. main_grad is fp32,
// or bf16/fp16 of dy's and x's dtype (optim.master_weights: fp32 compute, rounded once).
void wgrad_accumulate(const at::Tensor& main_grad, const at::Tensor& dy, const at::Tensor& x) {
  check_cuda(main_grad, main_grad, "main_grad");
  check_cuda(dy, main_grad, "dy");
  check_cuda(x, main_grad, "x");
  TORCH_CHECK(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0) && dy.scalar_type() == x.scalar_type(),
              "megaft.wgrad_accumulate: dy [M, N] and x [M, K] of one dtype expected, got ", dy.scalar_type(),
              " ", dy.sizes(), " and ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(main_grad.is_contiguous() && main_grad.sizes() == at::IntArrayRef({dy.size(1), x.size(1)}),
              "megaft.wgrad_accumulate: main_grad must be contiguous [", dy.size(1), ", ", x.size(1), "], got ",
              main_grad.sizes(), " with strides ", main_grad.strides());
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat || main_grad.scalar_type() == dy.scalar_type(),
              "megaft.wgrad_accumulate: main_grad must be float32 or dy's and x's dtype (", dy.scalar_type(),
              "), got ", main_grad.scalar_type(), "; fix: an fp32 main grad, or cast dy and x to ",
              main_grad.scalar_type());
  const c10::cuda::CUDAGuard guard(main_grad.device());
  const at::Tensor d = dy.contiguous(), xc = x.contiguous();
  const int err = megaft_wgrad_accumulate(at::cuda::getCurrentCUDABlasHandle(true), d.data_ptr(), xc.data_ptr(),
                                          main_grad.data_ptr(), d.size(0), d.size(1), xc.size(1), code_of(d, "dy"),
                                          code_of(main_grad, "main_grad"), stream_of(main_grad));
  TORCH_CHECK(err == 0, "megaft_wgrad_accumulate failed: cublasStatus_t ", err,
              " (sizes must fit int32; M=", d.size(0), " N=", d.size(1), " K=", xc.size(1), ")");
}

void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "megaft.linear_fwd: ", name, " must be contiguous (strides ", t.strides(),
              " for shape ", t.sizes(), "); pass ", name, ".contiguous()");
}

// y[..., N] = x[..., K] @ weight[N, K]^T (+ bias[N]) (+ residual[..., N]): one cuBLASLt matmul
// with the bias and the residual in its epilogue (linear_epilogue.cu). No silent copies:
// non-contiguous operands are an error that names the fix.
at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual) {
  check_cuda(x, x, "x");
  check_cuda(weight, x, "weight");
  const megaft_dtype type = code_of(x, "x");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && weight.size(1) == x.size(-1),
              "megaft.linear_fwd: x [..., K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "megaft.linear_fwd: weight is ", weight.scalar_type(),
              " and x is ", x.scalar_type(), "; cast both to the compute dtype");
  check_contiguous(x, "x");
  check_contiguous(weight, "weight");
  const int64_t k = x.size(-1), n = weight.size(0), m = k ? x.numel() / k : 0;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  const auto check_epilogue = [&](const std::optional<at::Tensor>& t, const char* name, at::IntArrayRef shape) {
    if (!t.has_value()) return;
    check_cuda(*t, x, name);
    TORCH_CHECK(t->sizes() == shape && t->scalar_type() == x.scalar_type(), "megaft.linear_fwd: ", name,
                " must be ", x.scalar_type(), " ", shape, ", got ", t->scalar_type(), " ", t->sizes());
    check_contiguous(*t, name);
  };
  check_epilogue(bias, "bias", {n});
  check_epilogue(residual, "residual", out_shape);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty(out_shape, x.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) {  // an empty sum: y is the epilogue alone
    y.zero_();
    if (bias.has_value()) y.add_(*bias);
    if (residual.has_value()) y.add_(*residual);
    return y;
  }
  // torch's own cuBLASLt workspace for this handle and stream (what its addmm uses): no
  // allocation per call on the forward's hot path.
  const size_t ws_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  void* ws = ws_bytes ? at::cuda::getCUDABlasLtWorkspace() : nullptr;
  const int err = megaft_linear_fwd(at::cuda::getCurrentCUDABlasLtHandle(), x.data_ptr(), weight.data_ptr(),
                                    bias.has_value() ? bias->data_ptr() : nullptr,
                                    residual.has_value() ? residual->data_ptr() : nullptr, y.data_ptr(), m, n, k,
                                    type, ws, ws_bytes, stream_of(x));
  TORCH_CHECK(err == 0, "megaft_linear_fwd failed: cublasStatus_t ", err, " (M=", m, " N=", n, " K=", k, ", ",
              x.scalar_type(), "; 15 = CUBLAS_STATUS_NOT_SUPPORTED: no cuBLASLt algorithm for this case)");
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megaft, m) {
  m.def("rmsnorm_fwd(Tensor x, Tensor weight, Tensor? residual, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("rmsnorm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd, Tensor? dh) -> (Tensor, Tensor)");
  m.def("swiglu_fwd(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_bwd(Tensor dy, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, bool backward) -> (Tensor, Tensor)");
  m.def("cross_entropy_fwd(Tensor logits, Tensor labels, int vocab_start, int n_real) -> (Tensor, Tensor, Tensor)");
  m.def("cross_entropy_bwd(Tensor logits, Tensor labels, Tensor lse, Tensor g, int vocab_start, int n_real) -> Tensor");
  m.def("cross_entropy_bwd_(Tensor(a!) logits, Tensor labels, Tensor lse, Tensor g, int vocab_start, "
        "int n_real) -> Tensor(a!)");
  m.def("wgrad_accumulate(Tensor(a!) main_grad, Tensor dy, Tensor x) -> ()");
  m.def("linear_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(megaft, CUDA, m) {
  m.impl("rmsnorm_fwd", &rmsnorm_fwd);
  m.impl("rmsnorm_bwd", &rmsnorm_bwd);
  m.impl("swiglu_fwd", &swiglu_fwd);
  m.impl("swiglu_bwd", &swiglu_bwd);
  m.impl("rope_fwd", &rope_fwd);
  m.impl("cross_entropy_fwd", &cross_entropy_fwd);
  m.impl("cross_entropy_bwd", &cross_entropy_bwd);
  m.impl("cross_entropy_bwd_", &cross_entropy_bwd_);
  m.impl("wgrad_accumulate", &wgrad_accumulate);
  m.impl("linear_fwd", &linear_fwd);
}
