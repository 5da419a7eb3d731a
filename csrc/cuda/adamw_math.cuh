// The AdamW element update shared by csrc/cuda/adamw*.cu: the scalars of one step and
// the per-element math, with every rounding pinned (see adamw.cu's header comment).
#pragma once

#include <math.h>
#include <stdint.h>

#include <cuda_runtime.h>

namespace megaft_adamw {

struct AdamwScalars {
  float decay;       // 1 - lr*wd (1 when wd == 0)
  float lerp_w;      // 1-beta1, or (1-beta1) - 1 when 1-beta1 >= 0.5 (torch's lerp)
  bool lerp_small;   // base m when |1-beta1| < 0.5, base g otherwise
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;    // sqrt(1 - beta2**step)
  float eps;
  float neg_step;    // -lr / (1 - beta1**step)
};

inline AdamwScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                                 double weight_decay) {
  // Double on the host, one rounding to float: what torch does with Python floats.
  const double bc1 = 1.0 - pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - pow(beta2, static_cast<double>(step));
  const float w = static_cast<float>(1.0 - beta1);
  const bool small = fabsf(w) < 0.5f;
  AdamwScalars s;
  s.decay = weight_decay != 0.0 ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.lerp_w = small ? w : w - 1.0f;
  s.lerp_small = small;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bc2_sqrt = static_cast<float>(pow(bc2, 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step = static_cast<float>(-(lr / bc1));
  return s;
}

__device__ __forceinline__ void adamw_elem(float& p, float g, float& m, float& v,
                                           const AdamwScalars& s) {
  const float base = s.lerp_small ? m : g;
  m = fmaf(s.lerp_w, __fsub_rn(g, m), base);
  v = fmaf(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(v, s.beta2));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
  p = __fadd_rn(__fmul_rn(p, s.decay), __fdiv_rn(__fmul_rn(s.neg_step, m), denom));
}

}  // namespace megaft_adamw
