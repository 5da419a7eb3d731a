// The parallel linears' forward GEMM with its epilogue fused, as one cuBLASLt matmul:
//   y = x @ w^T (+ bias) (+ residual)
// The bias goes through CUBLASLT_EPILOGUE_BIAS and the residual is cuBLASLt's C matrix
// with beta = 1 (D = alpha * op(A) op(B) + beta * C, C != D), so RowParallelLinear's
// bias + residual costs no extra pass over the output. Accumulation and epilogue are fp32
// (CUBLAS_COMPUTE_32F: no TF32 for fp32 inputs), rounded once to the output type.
//
// Row-major y[M, N] is column-major y^T [N, M] (ld N); x[M, K] is x^T [K, M] (ld K) and
// w[N, K] is w^T [K, N] (ld K). So in cuBLAS's terms
//   D[N, M] = op(A)[N, K] @ B[K, M]   with A = w (op T), B = x (op N), C = residual^T,
// and the bias, a vector over D's rows (N = output features), is broadcast over tokens.
// cuBLASLt has no SwiGLU epilogue: the gate/up projection is this GEMM, then swiglu.cu.
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include <cublasLt.h>

#include "cublas_types.h"
#include "megaft_kernels.h"

namespace {

// The largest power of two (<= 256) dividing the address, as torch tells cuBLASLt: its
// heuristics otherwise assume 256-byte aligned operands and may pick a vectorized
// kernel that faults on a view that starts mid-row.
uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (a % al) al /= 2;
  return al;
}

// Owns the descriptors of one call, destroyed on every return path.
struct LtCall {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {a, b, c, d})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

#define MEGAFT_LT_TRY(call)                                  \
  do {                                                       \
    const cublasStatus_t st_ = (call);                       \
    if (st_ != CUBLAS_STATUS_SUCCESS) return (int)st_;       \
  } while (0)

extern "C" int megaft_linear_fwd(struct cublasLtContext* handle, const void* x, const void* w,
                                 const void* bias, const void* residual, void* y, int64_t m,
                                 int64_t n, int64_t k, megaft_dtype type, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream) {
  cudaDataType_t t;
  if (!megaft_cublas_type(type, &t) || handle == nullptr || m < 0 || n < 0 || k <= 0)
    return (int)CUBLAS_STATUS_INVALID_VALUE;  // k = 0 has no GEMM: the caller fills y
  if (m == 0 || n == 0) return 0;
  LtCall lt;
  MEGAFT_LT_TRY(cublasLtMatmulDescCreate(&lt.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  MEGAFT_LT_TRY(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  MEGAFT_LT_TRY(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (bias != nullptr) {
    // The bias has D's type (the default of CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE); the
    // pointer is set before the heuristic query, which reads its alignment.
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    MEGAFT_LT_TRY(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    MEGAFT_LT_TRY(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  // Layouts describe the operands as stored (before op): A = w^T [K, N], B = x^T [K, M].
  MEGAFT_LT_TRY(cublasLtMatrixLayoutCreate(&lt.a, t, (uint64_t)k, (uint64_t)n, k));
  MEGAFT_LT_TRY(cublasLtMatrixLayoutCreate(&lt.b, t, (uint64_t)k, (uint64_t)m, k));
  MEGAFT_LT_TRY(cublasLtMatrixLayoutCreate(&lt.c, t, (uint64_t)n, (uint64_t)m, n));
  MEGAFT_LT_TRY(cublasLtMatrixLayoutCreate(&lt.d, t, (uint64_t)n, (uint64_t)m, n));
  // Without a residual C is unused (beta = 0); cuBLASLt still wants a valid pointer.
  const void* c = residual != nullptr ? residual : y;
  MEGAFT_LT_TRY(cublasLtMatmulPreferenceCreate(&lt.pref));
  const uint64_t ws = workspace != nullptr ? (uint64_t)workspace_bytes : 0;
  MEGAFT_LT_TRY(cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t al[4] = {alignment(w), alignment(x), alignment(c), alignment(y)};
  const cublasLtMatmulPreferenceAttributes_t al_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    MEGAFT_LT_TRY(cublasLtMatmulPreferenceSetAttribute(lt.pref, al_attr[i], &al[i], sizeof(al[i])));
  cublasLtMatmulHeuristicResult_t best = {};
  int found = 0;
  MEGAFT_LT_TRY(cublasLtMatmulAlgoGetHeuristic(handle, lt.op, lt.a, lt.b, lt.c, lt.d, lt.pref, 1, &best, &found));
  if (found == 0) return (int)CUBLAS_STATUS_NOT_SUPPORTED;
  const float alpha = 1.0f, beta = residual != nullptr ? 1.0f : 0.0f;
  return (int)cublasLtMatmul(handle, lt.op, &alpha, w, lt.a, x, lt.b, &beta, c, lt.c, y, lt.d, &best.algo,
                             ws ? workspace : nullptr, (size_t)ws, stream);
}
