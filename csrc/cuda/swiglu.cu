// SwiGLU's activation silu(gate) * up, elementwise, forward and backward, with the
// rounding of megaft/kernels/swiglu/reference.py: silu(g) is rounded to the input
// type before the multiply; backward recomputes sigmoid(g) instead of saving it.
#include <cstdint>

#include "kernel_math.cuh"
#include "megaft_kernels.h"

namespace {

using megaft::from_f;
using megaft::round_to;
using megaft::to_f;

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  // A grid-stride loop: enough blocks to fill any current GPU, never more than needed.
  const int64_t b = (n + kThreads - 1) / kThreads;
  return (unsigned)(b < 65536 ? b : 65536);
}

// expf, not __expf: matches torch's sigmoid to the ulp.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y,
                                  int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float gv = to_f(g[i]);
    y[i] = from_f<T>(round_to<T>(gv * sigmoid(gv)) * to_f(u[i]));
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ g,
                                  const T* __restrict__ u, T* __restrict__ dg, T* __restrict__ du,
                                  int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float d = to_f(dy[i]), gv = to_f(g[i]), uv = to_f(u[i]);
    const float s = sigmoid(gv);
    du[i] = from_f<T>(d * gv * s);
    dg[i] = from_f<T>(d * uv * s * (1.0f + gv * (1.0f - s)));
  }
}

}  // namespace

extern "C" int megaft_swiglu_fwd(const void* gate, const void* up, void* y, int64_t n,
                                 megaft_dtype type, cudaStream_t stream) {
  if (n == 0) return 0;
  MEGAFT_DISPATCH_TYPE(type, T,
      swiglu_fwd_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
          static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(y), n));
  return (int)cudaGetLastError();
}

extern "C" int megaft_swiglu_bwd(const void* dy, const void* gate, const void* up, void* d_gate,
                                 void* d_up, int64_t n, megaft_dtype type, cudaStream_t stream) {
  if (n == 0) return 0;
  MEGAFT_DISPATCH_TYPE(type, T,
      swiglu_bwd_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(gate), static_cast<const T*>(up),
          static_cast<T*>(d_gate), static_cast<T*>(d_up), n));
  return (int)cudaGetLastError();
}
