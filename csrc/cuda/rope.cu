// Rotary position embedding (rotate-half convention, megaft/kernels/rope/reference.py).
// One block per (batch, position); its threads walk heads x head_dim/2 pairs, so any
// even head dim and any head count (GQA: q and k are two calls) work. With x1, x2 the
// halves of a head and c, s the first half of the cos/sin row (the tables repeat it):
//   forward   y1 = x1 c - x2 s,   y2 = x2 c + x1 s;   backward: the same with -s.
// cos/sin are rounded to x's type first, products and the sum in fp32, rounded once.
#include <cstdint>

#include "kernel_math.cuh"
#include "megaft_kernels.h"

namespace {

using megaft::from_f;
using megaft::round_to;
using megaft::to_f;

struct Strides {
  int64_t b, h, s;
};

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, T* __restrict__ y, const float* __restrict__ cos,
                            const float* __restrict__ sin, int64_t seq, int64_t heads, int64_t half,
                            Strides xs, Strides ys, int64_t cs_stride, float sign) {
  const int64_t b = blockIdx.x / seq, pos = blockIdx.x % seq;
  const float* cr = cos + pos * cs_stride;
  const float* sr = sin + pos * cs_stride;
  for (int64_t i = threadIdx.x; i < heads * half; i += blockDim.x) {
    const int64_t head = i / half, j = i % half;
    const float c = round_to<T>(cr[j]), s = sign * round_to<T>(sr[j]);
    const T* xp = x + b * xs.b + head * xs.h + pos * xs.s;
    T* yp = y + b * ys.b + head * ys.h + pos * ys.s;
    const float x1 = to_f(xp[j]), x2 = to_f(xp[j + half]);
    yp[j] = from_f<T>(x1 * c - x2 * s);
    yp[j + half] = from_f<T>(x2 * c + x1 * s);
  }
}

}  // namespace

extern "C" int megaft_rope(const void* x, void* y, const float* cos, const float* sin, int64_t batch,
                           int64_t heads, int64_t seq, int64_t head_dim, const int64_t* x_strides,
                           const int64_t* y_strides, int64_t cs_stride, int backward,
                           megaft_dtype type, cudaStream_t stream) {
  if (head_dim % 2) return (int)cudaErrorInvalidValue;
  if (batch * seq * heads == 0) return 0;
  const int64_t half = head_dim / 2;
  const int64_t work = heads * half;
  const int threads = work >= 256 ? 256 : (int)((work + 31) / 32 * 32);
  const Strides xs{x_strides[0], x_strides[1], x_strides[2]};
  const Strides ys{y_strides[0], y_strides[1], y_strides[2]};
  MEGAFT_DISPATCH_TYPE(type, T,
      rope_kernel<T><<<(unsigned)(batch * seq), threads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), cos, sin, seq, heads, half, xs, ys,
          cs_stride, backward ? -1.0f : 1.0f));
  return (int)cudaGetLastError();
}
