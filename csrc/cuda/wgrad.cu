// Gradient-accumulation fusion: main_grad (fp32) += dy^T @ x with one cuBLAS GemmEx,
// beta = 1 into the fp32 buffer (Megatron's fused_weight_gradient_mlp_cuda). The
// weight gradient never exists in the compute dtype and is never added separately.
//
// Row-major main_grad [N, K] is column-major [K, N] with ld K, x [M, K] is column-major
// x^T [K, M] (ld K) and dy [M, N] is dy^T [N, M] (ld N), so in cuBLAS's terms
//   C[K, N] += A[K, M] @ B[N, M]^T   with A = x (op N), B = dy (op T).
// fp32 inputs use CUBLAS_COMPUTE_32F (no TF32), so the result is the fp32 matmul's.
#include <climits>
#include <cstdint>

#include <cublas_v2.h>

#include "megaft_kernels.h"

namespace {

bool data_type(megaft_dtype type, cudaDataType_t* out) {
  switch (type) {
    case MEGAFT_F32: *out = CUDA_R_32F; return true;
    case MEGAFT_F16: *out = CUDA_R_16F; return true;
    case MEGAFT_BF16: *out = CUDA_R_16BF; return true;
    default: return false;
  }
}

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

}  // namespace

extern "C" int megaft_wgrad_accumulate(struct cublasContext* handle, const void* dy, const void* x,
                                       float* main_grad, int64_t m, int64_t n, int64_t k,
                                       megaft_dtype type, cudaStream_t stream) {
  cudaDataType_t ab;
  if (!data_type(type, &ab) || !fits_int(m) || !fits_int(n) || !fits_int(k) || handle == nullptr)
    return (int)CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0 || k == 0) return 0;  // beta = 1: nothing to add
  cublasStatus_t st = cublasSetStream(handle, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return (int)st;
  const float alpha = 1.0f, beta = 1.0f;
  return (int)cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, (int)k, (int)n, (int)m, &alpha, x, ab,
                           (int)k, dy, ab, (int)n, &beta, main_grad, CUDA_R_32F, (int)k,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}
