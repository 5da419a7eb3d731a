// Vocabulary-parallel cross-entropy: the per-row statistics and the gradient, with the
// math of megaft/kernels/cross_entropy/chunked.py (the Triton kernels' twin):
//   stats  m = max_j x_j, s = sum_j exp(x_j - m), t = x_label (0 when the label is
//          not in this rank's slice [vocab_start, vocab_start + n_real)), all fp32
//   grad   dx_j = g * (exp(x_j - lse) - [j == label]) in x's type; padding columns
//          [n_real, n_cols) get 0
// The Python front combines (m, s, t) over tp. One block per row; the row is read once
// by the forward (online max/sum-exp per thread, then warp shuffles and one shared-
// memory step) and once by the backward, in its own type: no fp32 copy of the logits.
// Rows whose start is 16-byte aligned are read in 16-byte vectors. dx may be x itself
// (in place): each element is read and written by the same thread.
#include <cstdint>
#include <math.h>

#include "kernel_math.cuh"
#include "megaft_kernels.h"

namespace {

using megaft::from_f;
using megaft::to_f;

// exp(v) as exp2(v * log2 e): exp2f is one MUFU.EX2 (2 ulp) where expf adds a range
// reduction, and the forward does one exp per logit. The rounded product costs ~1e-6
// relative for the |v| < 30 that matter (as Triton's tl.exp, which lowers the same way).
__device__ __forceinline__ float fexp(float v) { return exp2f(v * 1.4426950408889634f); }

// (m, s) of the union of two sets of values; m = -inf marks an empty set (s = 0),
// which keeps -inf - -inf (NaN) out of the sums.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float big = fmaxf(m, m2);
  if (big == -INFINITY) return;
  s = s * fexp(m - big) + s2 * fexp(m2 - big);
  m = big;
}

// Folds one value into the running (m, s): rescale s only when the max grows.
__device__ __forceinline__ void push(float& m, float& s, float v) {
  if (v > m) {
    s = s * fexp(m - v) + 1.0f;  // exp(-inf) = 0 for the first value
    m = v;
  } else if (v != -INFINITY) {  // an all -inf prefix keeps (m, s) = (-inf, 0)
    s += fexp(v - m);
  }
}

// The block's (m, s) in every thread (blockDim.x a multiple of 32, <= 1024).
__device__ __forceinline__ void block_merge(float& m, float& s) {
  __shared__ float ms[32], ss[32];
  for (int off = 16; off > 0; off >>= 1)
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    ms[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  const int warps = (int)(blockDim.x >> 5);
  m = -INFINITY;
  s = 0.0f;
  for (int w = 0; w < warps; ++w) merge(m, s, ms[w], ss[w]);  // <= 32 values, same order everywhere
}

template <typename T>
struct alignas(16) Vec {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

template <typename T>
__device__ __forceinline__ bool aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

template <typename T>
__global__ void stats_kernel(const T* __restrict__ x, const int64_t* __restrict__ labels,
                             float* __restrict__ m_out, float* __restrict__ s_out,
                             float* __restrict__ t_out, int64_t n_real, int64_t stride,
                             int64_t vocab_start, int64_t ignore_index) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * stride;
  float m = -INFINITY, s = 0.0f;
  int64_t done = 0;
  if (aligned16(xr)) {  // uniform over the block
    constexpr int N = Vec<T>::kN;
    const int64_t vecs = n_real / N;
    const Vec<T>* xv = reinterpret_cast<const Vec<T>*>(xr);
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      const Vec<T> chunk = xv[i];
      float vals[N], top = -INFINITY;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        vals[k] = to_f(chunk.v[k]);
        top = fmaxf(top, vals[k]);
      }
      if (top > m) {
        s *= fexp(m - top);
        m = top;
      }
      if (m == -INFINITY) continue;  // all -inf so far: nothing to add
#pragma unroll
      for (int k = 0; k < N; ++k) s += fexp(vals[k] - m);
    }
    done = vecs * N;
  }
  for (int64_t c = done + threadIdx.x; c < n_real; c += blockDim.x) push(m, s, to_f(xr[c]));
  block_merge(m, s);
  if (threadIdx.x == 0) {
    const int64_t label = labels[row], local = label - vocab_start;
    const bool mine = label != ignore_index && local >= 0 && local < n_real;
    m_out[row] = m;
    s_out[row] = s;
    t_out[row] = mine ? to_f(xr[local]) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ T grad_of(T xv, int64_t col, int64_t local, int64_t n_real, float lse,
                                     float g) {
  if (col >= n_real) return from_f<T>(0.0f);
  float p = fexp(to_f(xv) - lse);
  if (col == local) p -= 1.0f;
  return from_f<T>(p * g);
}

template <typename T>
__global__ void grad_kernel(const T* x, const int64_t* __restrict__ labels,
                            const float* __restrict__ lse, const float* __restrict__ g, T* dx,
                            int64_t n_cols, int64_t n_real, int64_t x_stride, int64_t dx_stride,
                            int64_t vocab_start) {
  // x and dx may alias (in place), hence no __restrict__ on them.
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* dr = dx + row * dx_stride;
  const float l = lse[row], gr = g[row];
  const int64_t local = labels[row] - vocab_start;  // ignored rows have g = 0
  int64_t done = 0;
  if (aligned16(xr) && aligned16(dr)) {
    constexpr int N = Vec<T>::kN;
    const int64_t vecs = n_cols / N;
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      Vec<T> chunk = reinterpret_cast<const Vec<T>*>(xr)[i];
#pragma unroll
      for (int k = 0; k < N; ++k) chunk.v[k] = grad_of(chunk.v[k], i * N + k, local, n_real, l, gr);
      reinterpret_cast<Vec<T>*>(dr)[i] = chunk;
    }
    done = vecs * N;
  }
  for (int64_t c = done + threadIdx.x; c < n_cols; c += blockDim.x)
    dr[c] = grad_of(xr[c], c, local, n_real, l, gr);
}

int threads_for(int64_t n) {
  // One warp per 512 columns (64 16-byte vectors of bf16), 1..32 warps.
  int64_t warps = (n + 511) / 512;
  warps = warps < 1 ? 1 : (warps > 32 ? 32 : warps);
  return (int)(warps * 32);
}

// Rows are blocks: gridDim.x allows 2^31 - 1.
bool rows_fit(int64_t rows) { return rows >= 0 && rows <= 2147483647; }

}  // namespace

extern "C" int megaft_cross_entropy_fwd(const void* logits, const int64_t* labels, float* m, float* s,
                                        float* t, int64_t rows, int64_t n_real, int64_t stride,
                                        int64_t vocab_start, int64_t ignore_index, megaft_dtype type,
                                        cudaStream_t stream) {
  if (!rows_fit(rows) || n_real < 0) return (int)cudaErrorInvalidValue;
  if (rows == 0) return 0;
  MEGAFT_DISPATCH_TYPE(type, T,
      stats_kernel<T><<<(unsigned)rows, threads_for(n_real), 0, stream>>>(
          static_cast<const T*>(logits), labels, m, s, t, n_real, stride, vocab_start, ignore_index));
  return (int)cudaGetLastError();
}

extern "C" int megaft_cross_entropy_bwd(const void* logits, const int64_t* labels, const float* lse,
                                        const float* g, void* dx, int64_t rows, int64_t n_cols,
                                        int64_t n_real, int64_t x_stride, int64_t dx_stride,
                                        int64_t vocab_start, megaft_dtype type, cudaStream_t stream) {
  if (!rows_fit(rows) || n_real < 0 || n_real > n_cols) return (int)cudaErrorInvalidValue;
  if (rows == 0 || n_cols == 0) return 0;
  MEGAFT_DISPATCH_TYPE(type, T,
      grad_kernel<T><<<(unsigned)rows, threads_for(n_cols), 0, stream>>>(
          static_cast<const T*>(logits), labels, lse, g, static_cast<T*>(dx), n_cols, n_real,
          x_stride, dx_stride, vocab_start));
  return (int)cudaGetLastError();
}
