/* The C ABI of megaft's fused model kernels (RMSNorm, SwiGLU, RoPE) in csrc/cuda.
 *
 * Plain CUDA C++ behind this header, no torch headers, so the .cu files compile
 * with bare nvcc (tests/test_csrc_compile.py) and could be linked into a non-torch
 * program. The torch side is csrc/cuda/kernel_ops.cpp (torch.ops.megaft.*). Tensors
 * are raw pointers with a dtype code; rows are contiguous unless strides are given.
 * Every function returns a cudaError_t as int: 0 (cudaSuccess) or the launch error.
 * This header is valid C.
 */
#ifndef MEGAFT_KERNELS_H_
#define MEGAFT_KERNELS_H_

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

#ifdef __cplusplus
}
#endif

#endif /* MEGAFT_KERNELS_H_ */
