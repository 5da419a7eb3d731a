/* The C ABI of megaft's fused model kernels (RMSNorm, SwiGLU, RoPE, vocab-parallel
 * cross-entropy, the fp32 weight-gradient accumulation, the linears' cuBLASLt GEMM with
 * fused bias/residual epilogue) in csrc/cuda.
 *
 * Plain CUDA C++ behind this header, no torch headers, so the .cu files compile
 * with bare nvcc (tests/test_csrc_compile.py) and could be linked into a non-torch
 * program. The torch side is csrc/cuda/kernel_ops.cpp (torch.ops.megaft.*). Tensors
 * are raw pointers with a dtype code; rows are contiguous unless strides are given.
 * Every function returns a cudaError_t as int: 0 (cudaSuccess) or the launch error
 * (megaft_wgrad_accumulate, megaft_linear_fwd: a cublasStatus_t, 0 = CUBLAS_STATUS_SUCCESS).
 * This header is valid C and needs no cuBLAS header: cublasHandle_t is
 * `struct cublasContext *` and cublasLtHandle_t `struct cublasLtContext *`, declared
 * here as such.
 */
#ifndef MEGAFT_KERNELS_H_
#define MEGAFT_KERNELS_H_

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of the tensors passed as void pointers. */
typedef enum {
  MEGAFT_F32 = 0,
  MEGAFT_F16 = 1,
  MEGAFT_BF16 = 2
} megaft_dtype;

/* RMSNorm forward over rows x[rows, n] (contiguous rows). With residual != NULL,
 * h = x + residual (rounded to x's type) is stored and normalized instead of x.
 * y = w * round_x(h * rstd) in y's type; rstd[rows] (float) is kept for backward.
 * Supported (x, w, y) types: all equal, or x half/bf16 with w and y float. */
int megaft_rmsnorm_fwd(const void* x, const void* residual, const void* w, void* y, void* h,
                       float* rstd, int64_t rows, int64_t n, double eps, megaft_dtype x_type,
                       megaft_dtype w_type, megaft_dtype y_type, cudaStream_t stream);

/* RMSNorm backward: dx[rows, n] (x's type) from dy (y's type), the normalized input
 * x (h when fused), w and rstd; dh (x's type, may be NULL) is added to dx. Each of
 * `parts` blocks writes its partial weight gradient to dw_part[parts, n] (float),
 * which the caller sums over parts (parts <= rows). */
int megaft_rmsnorm_bwd(const void* dy, const void* x, const void* w, const float* rstd,
                       const void* dh, void* dx, float* dw_part, int64_t rows, int64_t n,
                       int parts, megaft_dtype x_type, megaft_dtype w_type, megaft_dtype y_type,
                       cudaStream_t stream);

/* SwiGLU activation y = round(silu(g)) * u elementwise over n contiguous elements. */
int megaft_swiglu_fwd(const void* gate, const void* up, void* y, int64_t n, megaft_dtype type,
                      cudaStream_t stream);

/* SwiGLU backward: d_up = dy * silu(g), d_gate = dy * u * s * (1 + g (1 - s)), s = sigmoid(g). */
int megaft_swiglu_bwd(const void* dy, const void* gate, const void* up, void* d_gate, void* d_up,
                      int64_t n, megaft_dtype type, cudaStream_t stream);

/* Rotary embedding of one [batch, heads, seq, head_dim] tensor x into y (strides in
 * elements for dims 0..2, the last dim contiguous), rotate-half convention, with
 * cos/sin [seq, head_dim] float tables (row stride cs_stride); backward != 0
 * rotates by the negative angle (the gradient). cos/sin are rounded to x's type
 * first, as the torch reference does. */
int megaft_rope(const void* x, void* y, const float* cos, const float* sin, int64_t batch,
                int64_t heads, int64_t seq, int64_t head_dim, const int64_t* x_strides,
                const int64_t* y_strides, int64_t cs_stride, int backward, megaft_dtype type,
                cudaStream_t stream);

/* Vocab-parallel cross-entropy statistics of rows x[rows, :n_real] (row stride
 * `stride` elements; this rank's vocabulary slice starts at vocab_start): per row
 * m = max, s = sum exp(x - m), t = x[label - vocab_start] when the label falls in the
 * slice and is not ignore_index, else 0 (all float). The caller combines them over tp. */
int megaft_cross_entropy_fwd(const void* logits, const int64_t* labels, float* m, float* s, float* t,
                             int64_t rows, int64_t n_real, int64_t stride, int64_t vocab_start,
                             int64_t ignore_index, megaft_dtype type, cudaStream_t stream);

/* Cross-entropy gradient dx[rows, n_cols] = g * (exp(x - lse) - onehot(label - vocab_start))
 * in x's type, 0 in the padding columns [n_real, n_cols); g[row] = 0 for ignored rows.
 * dx may be logits itself (in place, same strides). */
int megaft_cross_entropy_bwd(const void* logits, const int64_t* labels, const float* lse,
                             const float* g, void* dx, int64_t rows, int64_t n_cols, int64_t n_real,
                             int64_t x_stride, int64_t dx_stride, int64_t vocab_start,
                             megaft_dtype type, cudaStream_t stream);

struct cublasContext;

/* main_grad[n, k] (contiguous, of `grad_type`: MEGAFT_F32, or `type` itself when that is
 * 16-bit) += dy[m, n]^T @ x[m, k] (dy, x contiguous, of `type`) with one cublasGemmEx
 * (fp32 compute, beta = 1, the sum rounded once to grad_type) on `stream`; handle is a
 * cublasHandle_t (torch's, from the binding). Returns a cublasStatus_t
 * (CUBLAS_STATUS_INVALID_VALUE for another dtype pairing). */
int megaft_wgrad_accumulate(struct cublasContext* handle, const void* dy, const void* x,
                            void* main_grad, int64_t m, int64_t n, int64_t k, megaft_dtype type,
                            megaft_dtype grad_type, cudaStream_t stream);

struct cublasLtContext;

/* y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) (+ residual[m, n]) in one cuBLASLt matmul
 * (csrc/cuda/linear_epilogue.cu): bias through CUBLASLT_EPILOGUE_BIAS, residual as C
 * with beta = 1; bias and residual may be NULL. All tensors contiguous, of `type`,
 * residual != y; fp32 compute, one rounding. handle is a cublasLtHandle_t (torch's);
 * workspace (may be NULL) is device memory of workspace_bytes usable on `stream`.
 * k must be >= 1 (k = 0 is no GEMM). Returns a cublasStatus_t
 * (CUBLAS_STATUS_NOT_SUPPORTED when cuBLASLt has no algorithm for the case). */
int megaft_linear_fwd(struct cublasLtContext* handle, const void* x, const void* w,
                      const void* bias, const void* residual, void* y, int64_t m, int64_t n,
                      int64_t k, megaft_dtype type, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MEGAFT_KERNELS_H_ */
