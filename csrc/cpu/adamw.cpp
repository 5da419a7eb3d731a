// Fused AdamW step on the CPU for flat fp32 tensors (optimizer offload, ZeRO shards).
//
// The specification is megaft/kernels/adamw/reference.py, which mirrors torch's
// `_single_tensor_adam` (torch/optim/adam.py) with decoupled weight decay:
//   p  *= 1 - lr*wd                           (skipped by torch when wd == 0; *1.0f is exact)
//   m   = lerp(m, g, 1 - beta1)               (torch's vectorized lerp: one fma)
//   v   = v*beta2 + ((1 - beta2)*g)*g         (torch's vectorized addcmul: one fma)
//   p  += (-lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps)
// Scalars are computed in double on the host and rounded to float once, as torch
// does with Python floats. One pass reads p,g,m,v and writes p,m,v: 28 bytes/param,
// so the kernel is memory-bound; the inner loop only has to vectorize.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "adamw_checks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>

// GCC function multiversioning: one clone per ISA level, picked at load time by an
// ifunc resolver, so the wheel runs on any x86-64 yet uses AVX-512/AVX2+FMA where
// present (no -march=native). The "default" clone is correct but slow where the
// CPU has no FMA (fmaf becomes a libm call); every x86 server since 2013 has it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEGAFT_SIMD_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define MEGAFT_SIMD_CLONES_NAME "target_clones(x86-64-v4,x86-64-v3,default)"
#else
#define MEGAFT_SIMD_CLONES
#define MEGAFT_SIMD_CLONES_NAME "none (compiler default ISA)"
#endif

namespace megaft::cpu {
namespace {

// The per-step scalars, each a float rounded once from a double (see header comment).
struct AdamwScalars {
  float decay;      // 1 - lr*wd (1 when wd == 0)
  float lerp_w;     // lerp coefficient: 1-beta1, or (1-beta1) - 1 when 1-beta1 >= 0.5
  bool lerp_small;  // torch's lerp uses base m when |w| < 0.5, base g otherwise
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;   // sqrt(1 - beta2**step)
  float eps;
  float neg_step;   // -lr / (1 - beta1**step)
};

AdamwScalars make_scalars(int64_t step, double lr, double beta1, double beta2,
                          double eps, double weight_decay) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const float w = static_cast<float>(1.0 - beta1);
  const bool small = std::fabs(w) < 0.5f;
  AdamwScalars s;
  s.decay = weight_decay != 0.0 ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.lerp_w = small ? w : w - 1.0f;  // torch computes weight - 1 in float, so do we
  s.lerp_small = small;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));  // Python's `bc2 ** 0.5`
  s.eps = static_cast<float>(eps);
  s.neg_step = static_cast<float>(-(lr / bc1));
  return s;
}

// The inner loop over one thread's contiguous range. __restrict__ and the absence
// of branches let GCC vectorize it; -ffp-contract=off (setup.py) keeps every fma
// explicit, so the rounding is the one written here on every compiler.
MEGAFT_SIMD_CLONES
void adamw_range(float* __restrict__ p, const float* __restrict__ g,
                 float* __restrict__ m, float* __restrict__ v, int64_t n,
                 const AdamwScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi_old = m[i];
    const float base = s.lerp_small ? mi_old : gi;
    const float mi = std::fma(s.lerp_w, gi - mi_old, base);
    const float vi = std::fma(s.one_minus_beta2 * gi, gi, v[i] * s.beta2);
    const float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;
    p[i] = p[i] * s.decay + (s.neg_step * mi) / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace

// Work unit: 32768 floats = 128 KiB per array (~1 MB of traffic, ~0.1 ms). Tensors
// of one block stay on the calling thread (no fork/join cost).
constexpr int64_t kBlock = 32768;

void adamw_step_(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                 at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1,
                 double beta2, double eps, double weight_decay) {
  check_adamw_args(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                   /*cuda=*/false, "megaft._C");

  const AdamwScalars s = make_scalars(step, lr, beta1, beta2, eps, weight_decay);
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const int64_t n = param.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  // One worker per torch thread, each taking the next block from a shared counter
  // instead of at::parallel_for's one static range per thread: on a shared node a
  // preempted thread then delays the step by one block, not by half the tensor.
  // Every element is computed alike wherever the blocks fall: results are exact
  // and independent of the thread count.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), blocks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
      const int64_t begin = b * kBlock;
      adamw_range(p + begin, g + begin, m + begin, v + begin,
                  std::min(kBlock, n - begin), s);
    }
  });
}

// What this build can do, for megaft.env_report(): at::parallel_for only runs in
// parallel when the extension itself was compiled with OpenMP (ATen's OpenMP
// backend is a header template), so a build without -fopenmp is single-threaded.
std::string build_info() {
  std::string info = "simd: " MEGAFT_SIMD_CLONES_NAME;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  info += __builtin_cpu_supports("x86-64-v4")   ? " (running x86-64-v4)"
          : __builtin_cpu_supports("x86-64-v3") ? " (running x86-64-v3)"
                                                : " (running default)";
#endif
#ifdef _OPENMP
  info += "; threads: at::parallel_for over OpenMP";
#else
  info += "; threads: none (built without OpenMP)";
#endif
  return info;
}

}  // namespace megaft::cpu
