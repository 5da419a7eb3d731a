// Fused AdamW step on the GPU for flat fp32 tensors: plain CUDA C++ behind the C
// ABI of megaft_cuda.h (no torch headers). Same math, same rounding steps as
// csrc/cpu/adamw.cpp and megaft/kernels/adamw/reference.py:
//   p  = p*(1 - lr*wd) + (-lr/bc1 * m') / (sqrt(v')/sqrt(bc2) + eps)
//   m' = lerp(m, g, 1 - beta1)   (one fma, as torch's lerp)
//   v' = fma((1 - beta2)*g, g, v*beta2)
// The _rn intrinsics pin each rounding so that nvcc's fma contraction or
// --use_fast_math cannot change the result.
#include <stdint.h>

#include <cuda_runtime.h>

#include "adamw_math.cuh"
#include "megaft_cuda.h"

namespace {

using megaft_adamw::AdamwScalars;
using megaft_adamw::adamw_elem;
using megaft_adamw::make_scalars;

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // enough resident warps to saturate HBM with grid-stride loops

// kVec4: all four pointers are 16-byte aligned, so the body moves float4s (one
// 128-bit load/store per array per thread) and a few threads finish the < 4 tail.
template <bool kVec4>
__global__ void __launch_bounds__(kThreads)
adamw_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
             float* __restrict__ v, int64_t n, AdamwScalars s) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (kVec4) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      float4 pv = reinterpret_cast<float4*>(p)[i];
      const float4 gv = reinterpret_cast<const float4*>(g)[i];
      float4 mv = reinterpret_cast<float4*>(m)[i];
      float4 vv = reinterpret_cast<float4*>(v)[i];
      adamw_elem(pv.x, gv.x, mv.x, vv.x, s);
      adamw_elem(pv.y, gv.y, mv.y, vv.y, s);
      adamw_elem(pv.z, gv.z, mv.z, vv.z, s);
      adamw_elem(pv.w, gv.w, mv.w, vv.w, s);
      reinterpret_cast<float4*>(p)[i] = pv;
      reinterpret_cast<float4*>(m)[i] = mv;
      reinterpret_cast<float4*>(v)[i] = vv;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_elem(pi, g[i], mi, vi, s);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

int blocks_for(int64_t work_items) {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    sms = 132;  // H100 SXM; only the grid size depends on it, never the result
  const int64_t wanted = (work_items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * kBlocksPerSm;
  return static_cast<int>(wanted < cap ? (wanted > 0 ? wanted : 1) : cap);
}

}  // namespace

extern "C" int megaft_adamw_fp32(float* p, const float* g, float* m, float* v, int64_t n,
                                 int64_t step, double lr, double beta1, double beta2,
                                 double eps, double weight_decay, cudaStream_t stream) {
  if (n <= 0) return static_cast<int>(cudaSuccess);
  const AdamwScalars s = make_scalars(step, lr, beta1, beta2, eps, weight_decay);
  const uintptr_t any = reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(g) |
                        reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v);
  if (any % 16 == 0) {
    adamw_kernel<true><<<blocks_for(n / 4 + 1), kThreads, 0, stream>>>(p, g, m, v, n, s);
  } else {
    adamw_kernel<false><<<blocks_for(n), kThreads, 0, stream>>>(p, g, m, v, n, s);
  }
  return static_cast<int>(cudaGetLastError());
}
