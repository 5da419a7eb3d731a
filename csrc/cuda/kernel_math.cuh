// Shared device helpers of the fused model kernels: element type conversions
// (fp32 math, one rounding per stored value, round-to-nearest-even like torch)
// and a block-wide sum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "megaft_kernels.h"

namespace megaft {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Round v to T and back: the reference rounds some intermediates to the input type.
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f(from_f<T>(v)); }

// Sum of v over the block (blockDim.x a multiple of 32, <= 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  __shared__ float total;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) total = v;
  }
  __syncthreads();
  const float out = total;
  __syncthreads();  // warp_sums/total are reused by the next call
  return out;
}

}  // namespace megaft

// Instantiate `CALL` (a macro taking the C++ types) for a megaft_dtype code; returns
// cudaErrorInvalidValue from the enclosing function for an unknown code.
#define MEGAFT_DISPATCH_TYPE(code, T, ...)                         \
  switch (code) {                                                  \
    case MEGAFT_F32: { using T = float; __VA_ARGS__; break; }      \
    case MEGAFT_F16: { using T = __half; __VA_ARGS__; break; }     \
    case MEGAFT_BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return (int)cudaErrorInvalidValue;                    \
  }
