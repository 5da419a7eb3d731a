// RMSNorm (optionally with the residual add fused in front), forward and backward.
// Same math and rounding as megaft/kernels/rmsnorm/reference.py: normalize in fp32,
// round the normalized row to x's type, multiply by the weight in y's type.
// Forward: one block per row, the row streamed twice from global memory (sum of
// squares, then the output; the second pass hits L1/L2 for model widths).
// Backward: `parts` blocks, each walking a contiguous range of rows, writing dx per
// row and accumulating its own row of partial dw in fp32 (summed by the caller).
#include <cstdint>

#include "kernel_math.cuh"
#include "megaft_kernels.h"

namespace {

using megaft::block_sum;
using megaft::from_f;
using megaft::round_to;
using megaft::to_f;

int threads_for(int64_t n) {
  // One warp per 128 elements, at least 1 and at most 32 warps.
  int64_t warps = (n + 127) / 128;
  warps = warps < 1 ? 1 : (warps > 32 ? 32 : warps);
  return (int)(warps * 32);
}

template <typename T, typename W, typename Y>
__global__ void rmsnorm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                   const W* __restrict__ w, Y* __restrict__ y, T* __restrict__ h,
                                   float* __restrict__ rstd, int64_t n, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * n;
  const T* rr = res ? res + row * n : nullptr;
  T* hr = h ? h + row * n : nullptr;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    float v = to_f(xr[c]);
    if (rr) {
      const T s = from_f<T>(v + to_f(rr[c]));
      hr[c] = s;
      v = to_f(s);
    }
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss) / (float)n + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  const T* src = rr ? hr : xr;  // h was written by this thread above: same c, same thread
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    const float normed = round_to<T>(to_f(src[c]) * r);
    y[row * n + c] = from_f<Y>(normed * to_f(w[c]));
  }
}

template <typename T, typename W, typename Y>
__global__ void rmsnorm_bwd_kernel(const Y* __restrict__ dy, const T* __restrict__ x,
                                   const W* __restrict__ w, const float* __restrict__ rstd,
                                   const T* __restrict__ dh, T* __restrict__ dx,
                                   float* __restrict__ dw_part, int64_t rows, int64_t n,
                                   int64_t rows_per_part) {
  const int64_t first = blockIdx.x * rows_per_part;
  const int64_t last = first + rows_per_part < rows ? first + rows_per_part : rows;
  float* dwp = dw_part + blockIdx.x * n;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) dwp[c] = 0.0f;
  for (int64_t row = first; row < last; ++row) {
    const float r = rstd[row];
    const T* xr = x + row * n;
    const Y* dyr = dy + row * n;
    float dot = 0.0f;  // sum(dy * w * xhat)
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const float xhat = to_f(xr[c]) * r;
      const float g = to_f(dyr[c]) * to_f(w[c]);
      dot += g * xhat;
      // dw sees the normalized row rounded to x's type, as the forward used it.
      dwp[c] += to_f(dyr[c]) * round_to<T>(xhat);
    }
    dot = block_sum(dot) / (float)n;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      const float xhat = to_f(xr[c]) * r;
      float d = r * (to_f(dyr[c]) * to_f(w[c]) - xhat * dot);
      if (dh) d += to_f(dh[row * n + c]);
      dx[row * n + c] = from_f<T>(d);
    }
  }
}

template <typename T, typename W, typename Y>
int fwd(const void* x, const void* res, const void* w, void* y, void* h, float* rstd,
        int64_t rows, int64_t n, double eps, cudaStream_t stream) {
  if (rows == 0) return 0;
  rmsnorm_fwd_kernel<T, W, Y><<<(unsigned)rows, threads_for(n), 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const W*>(w),
      static_cast<Y*>(y), static_cast<T*>(h), rstd, n, (float)eps);
  return (int)cudaGetLastError();
}

template <typename T, typename W, typename Y>
int bwd(const void* dy, const void* x, const void* w, const float* rstd, const void* dh, void* dx,
        float* dw_part, int64_t rows, int64_t n, int parts, cudaStream_t stream) {
  if (rows == 0) return 0;
  if (parts < 1 || parts > rows) return (int)cudaErrorInvalidValue;
  const int64_t per = (rows + parts - 1) / parts;
  rmsnorm_bwd_kernel<T, W, Y><<<(unsigned)parts, threads_for(n), 0, stream>>>(
      static_cast<const Y*>(dy), static_cast<const T*>(x), static_cast<const W*>(w), rstd,
      static_cast<const T*>(dh), static_cast<T*>(dx), dw_part, rows, n, per);
  return (int)cudaGetLastError();
}

}  // namespace

// (x, w, y) types: all equal, or x half/bf16 with w and y float (promote(x, w)).
#define MEGAFT_RMSNORM_DISPATCH(CALL)                                              \
  if (w_type == x_type && y_type == x_type) {                                      \
    MEGAFT_DISPATCH_TYPE(x_type, T, return CALL(T, T, T));                         \
  } else if (w_type == MEGAFT_F32 && y_type == MEGAFT_F32) {                       \
    MEGAFT_DISPATCH_TYPE(x_type, T, return CALL(T, float, float));                 \
  }                                                                                \
  return (int)cudaErrorInvalidValue;

extern "C" int megaft_rmsnorm_fwd(const void* x, const void* residual, const void* w, void* y,
                                  void* h, float* rstd, int64_t rows, int64_t n, double eps,
                                  megaft_dtype x_type, megaft_dtype w_type, megaft_dtype y_type,
                                  cudaStream_t stream) {
#define CALL(T, W, Y) fwd<T, W, Y>(x, residual, w, y, h, rstd, rows, n, eps, stream)
  MEGAFT_RMSNORM_DISPATCH(CALL)
#undef CALL
}

extern "C" int megaft_rmsnorm_bwd(const void* dy, const void* x, const void* w, const float* rstd,
                                  const void* dh, void* dx, float* dw_part, int64_t rows, int64_t n,
                                  int parts, megaft_dtype x_type, megaft_dtype w_type,
                                  megaft_dtype y_type, cudaStream_t stream) {
#define CALL(T, W, Y) bwd<T, W, Y>(dy, x, w, rstd, dh, dx, dw_part, rows, n, parts, stream)
  MEGAFT_RMSNORM_DISPATCH(CALL)
#undef CALL
}
