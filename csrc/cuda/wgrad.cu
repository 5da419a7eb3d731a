// Gradient-accumulation fusion: main_grad += dy^T @ x with one cuBLAS GemmEx, beta = 1
// into the buffer (Megatron's fused_weight_gradient_mlp_cuda). The weight gradient never
// exists in the compute dtype and is never added separately. main_grad is fp32
// (wgrad_gemm_accum_fp32), or bf16/fp16 of dy's and x's own type (optim.master_weights;
// wgrad_gemm_accum_fp16): cuBLAS computes alpha * A @ B + beta * C in fp32 and rounds D
// once to C's type (one rounding where a separate dw + add would round twice).
//
// Row-major main_grad [N, K] is column-major [K, N] with ld K, x [M, K] is column-major
// x^T [K, M] (ld K) and dy [M, N] is dy^T [N, M] (ld N), so in cuBLAS's terms
//   C[K, N] += A[K, M] @ B[N, M]^T   with A = x (op N), B = dy (op T).
// fp32 inputs use CUBLAS_COMPUTE_32F (no TF32), so the result is the fp32 matmul's.
#include <climits>
#include <cstdint>

#include <cublas_v2.h>

#include "cublas_types.h"
#include "megaft_kernels.h"

namespace {

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

}  // namespace

extern "C" int megaft_wgrad_accumulate(struct cublasContext* handle, const void* dy, const void* x,
                                       void* main_grad, int64_t m, int64_t n, int64_t k,
                                       megaft_dtype type, megaft_dtype grad_type, cudaStream_t stream) {
  cudaDataType_t ab, c;
  if (!megaft_cublas_type(type, &ab) || !megaft_cublas_type(grad_type, &c) || !fits_int(m) || !fits_int(n) ||
      !fits_int(k) || handle == nullptr)
    return (int)CUBLAS_STATUS_INVALID_VALUE;
  // GemmEx with CUBLAS_COMPUTE_32F takes C of fp32 (any A/B) or of A/B's own 16-bit type
  if (grad_type != MEGAFT_F32 && grad_type != type) return (int)CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0 || k == 0) return 0;  // beta = 1: nothing to add
  cublasStatus_t st = cublasSetStream(handle, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return (int)st;
  const float alpha = 1.0f, beta = 1.0f;
  return (int)cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, (int)k, (int)n, (int)m, &alpha, x, ab,
                           (int)k, dy, ab, (int)n, &beta, main_grad, c, (int)k,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}
