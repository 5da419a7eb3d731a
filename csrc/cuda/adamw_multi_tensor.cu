// Multi-tensor AdamW on the GPU: apex's multi_tensor_apply idea in plain CUDA C++
// behind the C ABI of megaft_cuda.h. The host packs up to kMaxTensors tensors'
// pointers, sizes and per-tensor scalars plus a table of up to kMaxBlocks
// (tensor, chunk) pairs into one kernel-argument struct (< 4 KB, passed by value),
// launches one block per chunk, and starts a new struct when either table is full
// (a tensor cut across two launches continues as slot 0 of the next).
//
// Params are fp32, or bf16 (stored as uint16 bit patterns) with fp32 masters; grads
// fp32 or bf16; moments fp32. The element math is adamw_math.cuh's, so results equal
// adamw.cu, megaft._C and the Triton kernel bit for bit; bf16 is rounded to nearest
// even on the bit pattern, as torch's .to(torch.bfloat16).
#include <stdint.h>

#include <cuda_runtime.h>

#include "adamw_math.cuh"
#include "megaft_cuda.h"

namespace {

using megaft_adamw::AdamwScalars;
using megaft_adamw::adamw_elem;
using megaft_adamw::make_scalars;

constexpr int kThreads = 512;
constexpr int kIlp = 4;             // elements per thread per iteration (one 16-byte fp32 load)
constexpr int64_t kChunk = 65536;   // elements per block: 64 iterations of 512 x 4
constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;

struct TensorListArgs {
  void* p[kMaxTensors];
  const void* g[kMaxTensors];
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  float* master[kMaxTensors];  // == p when there are no masters (fp32 params)
  int64_t n[kMaxTensors];
  float decay[kMaxTensors];     // per tensor: weight decay and lr differ by group,
  float neg_step[kMaxTensors];  // and step (bias corrections) may too
  float bc2_sqrt[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};
// Kernel parameters are limited to 4 KB on every architecture we build for.
static_assert(sizeof(TensorListArgs) + sizeof(AdamwScalars) <= 4000, "kernel args too large");

struct Bf16 {  // a bf16 value as its bit pattern: no cuda_bf16.h types in the math
  uint16_t bits;
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(Bf16 x) {
  return __uint_as_float(static_cast<uint32_t>(x.bits) << 16);
}
__device__ __forceinline__ void store_as(float x, float* out) { *out = x; }
__device__ __forceinline__ void store_as(float x, Bf16* out) {
  // Round to nearest even (c10's round_to_nearest_even); NaN -> canonical 0x7FC0.
  const uint32_t bits = __float_as_uint(x);
  const uint32_t rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  out->bits = x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

template <typename T>
struct alignas(sizeof(T) * kIlp) Vec {
  T x[kIlp];
};

template <typename T>
__device__ __forceinline__ bool aligned(const T* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % sizeof(Vec<T>) == 0;
}

// Chunk blockIdx.x of its tensor. kMaster: the update runs on the fp32 master and the
// param (PT) receives it rounded; otherwise PT is float and the param is the master.
template <typename PT, typename GT, bool kMaster>
__global__ void __launch_bounds__(kThreads)
adamw_multi_tensor_kernel(TensorListArgs args, AdamwScalars shared) {
  const int t = args.block_tensor[blockIdx.x];
  const int64_t base = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunk;
  const int64_t len = args.n[t] - base < kChunk ? args.n[t] - base : kChunk;
  AdamwScalars s = shared;
  s.decay = args.decay[t];
  s.neg_step = args.neg_step[t];
  s.bc2_sqrt = args.bc2_sqrt[t];
  PT* p = static_cast<PT*>(args.p[t]) + base;
  const GT* g = static_cast<const GT*>(args.g[t]) + base;
  float* m = args.m[t] + base;
  float* v = args.v[t] + base;
  float* w = args.master[t] + base;

  if (len % kIlp == 0 && aligned(p) && aligned(g) && aligned(m) && aligned(v) && aligned(w)) {
    for (int64_t i = threadIdx.x; i < len / kIlp; i += blockDim.x) {
      const Vec<GT> gv = reinterpret_cast<const Vec<GT>*>(g)[i];
      Vec<float> mv = reinterpret_cast<Vec<float>*>(m)[i];
      Vec<float> vv = reinterpret_cast<Vec<float>*>(v)[i];
      Vec<float> wv = reinterpret_cast<Vec<float>*>(w)[i];
      Vec<PT> pv;
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        adamw_elem(wv.x[k], to_f32(gv.x[k]), mv.x[k], vv.x[k], s);
        store_as(wv.x[k], &pv.x[k]);
      }
      reinterpret_cast<Vec<float>*>(m)[i] = mv;
      reinterpret_cast<Vec<float>*>(v)[i] = vv;
      reinterpret_cast<Vec<float>*>(w)[i] = wv;
      if (kMaster) reinterpret_cast<Vec<PT>*>(p)[i] = pv;
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    float wi = w[i], mi = m[i], vi = v[i];
    adamw_elem(wi, to_f32(g[i]), mi, vi, s);
    m[i] = mi;
    v[i] = vi;
    w[i] = wi;
    if (kMaster) store_as(wi, &p[i]);
  }
}

struct Lists {
  int64_t count;
  void* const* p;
  const void* const* g;
  float* const* m;
  float* const* v;
  float* const* master;  // NULL: fp32 params are their own masters
  const int64_t* n;
  const int64_t* steps;
  const double* lrs;
  const double* wds;
};

template <typename PT, typename GT, bool kMaster>
int launch_all(const Lists& l, double beta1, double beta2, double eps, cudaStream_t stream) {
  const AdamwScalars shared = make_scalars(1, 0.0, beta1, beta2, eps, 0.0);
  TensorListArgs args;
  int loc_tensor = 0, loc_block = 0;
  int64_t last = -1;  // the last non-empty tensor: its last chunk flushes the struct
  for (int64_t t = 0; t < l.count; ++t)
    if (l.n[t] > 0) last = t;
  for (int64_t t = 0; t <= last; ++t) {
    if (l.n[t] <= 0) continue;
    const AdamwScalars st = make_scalars(l.steps[t], l.lrs[t], beta1, beta2, eps, l.wds[t]);
    args.p[loc_tensor] = l.p[t];
    args.g[loc_tensor] = l.g[t];
    args.m[loc_tensor] = l.m[t];
    args.v[loc_tensor] = l.v[t];
    args.master[loc_tensor] = kMaster ? l.master[t] : static_cast<float*>(l.p[t]);
    args.n[loc_tensor] = l.n[t];
    args.decay[loc_tensor] = st.decay;
    args.neg_step[loc_tensor] = st.neg_step;
    args.bc2_sqrt[loc_tensor] = st.bc2_sqrt;
    ++loc_tensor;
    const int64_t chunks = (l.n[t] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      args.block_tensor[loc_block] = static_cast<unsigned char>(loc_tensor - 1);
      args.block_chunk[loc_block] = static_cast<int>(c);
      ++loc_block;
      const bool tensor_done = c == chunks - 1;
      if (loc_block == kMaxBlocks || (tensor_done && (loc_tensor == kMaxTensors || t == last))) {
        adamw_multi_tensor_kernel<PT, GT, kMaster><<<loc_block, kThreads, 0, stream>>>(args, shared);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return static_cast<int>(err);
        loc_block = 0;
        if (tensor_done) {
          loc_tensor = 0;
        } else {  // the tensor continues in the next launch, as slot 0
          const int from = loc_tensor - 1;
          args.p[0] = args.p[from];
          args.g[0] = args.g[from];
          args.m[0] = args.m[from];
          args.v[0] = args.v[from];
          args.master[0] = args.master[from];
          args.n[0] = args.n[from];
          args.decay[0] = args.decay[from];
          args.neg_step[0] = args.neg_step[from];
          args.bc2_sqrt[0] = args.bc2_sqrt[from];
          loc_tensor = 1;
        }
      }
    }
  }
  return static_cast<int>(cudaSuccess);
}

template <typename PT, bool kMaster>
int dispatch_grad(const Lists& l, int grad_dtype, double beta1, double beta2, double eps,
                  cudaStream_t stream) {
  if (grad_dtype == MEGAFT_ADAMW_FP32)
    return launch_all<PT, float, kMaster>(l, beta1, beta2, eps, stream);
  if (grad_dtype == MEGAFT_ADAMW_BF16)
    return launch_all<PT, Bf16, kMaster>(l, beta1, beta2, eps, stream);
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

extern "C" int megaft_adamw_multi_tensor(int64_t num_tensors, void* const* params,
                                         const void* const* grads, float* const* exp_avgs,
                                         float* const* exp_avg_sqs, float* const* master_params,
                                         const int64_t* numels, const int64_t* steps,
                                         const double* lrs, const double* weight_decays,
                                         double beta1, double beta2, double eps, int param_dtype,
                                         int grad_dtype, cudaStream_t stream) {
  if (num_tensors <= 0) return static_cast<int>(cudaSuccess);
  const Lists l{num_tensors, params, grads, exp_avgs, exp_avg_sqs, master_params,
                numels, steps, lrs, weight_decays};
  if (master_params == nullptr) {
    if (param_dtype != MEGAFT_ADAMW_FP32) return static_cast<int>(cudaErrorInvalidValue);
    return dispatch_grad<float, false>(l, grad_dtype, beta1, beta2, eps, stream);
  }
  if (param_dtype == MEGAFT_ADAMW_FP32)
    return dispatch_grad<float, true>(l, grad_dtype, beta1, beta2, eps, stream);
  if (param_dtype == MEGAFT_ADAMW_BF16)
    return dispatch_grad<Bf16, true>(l, grad_dtype, beta1, beta2, eps, stream);
  return static_cast<int>(cudaErrorInvalidValue);
}
