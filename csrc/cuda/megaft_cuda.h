/* The small C ABI of megaft's CUDA kernels (the .cu files in csrc/cuda).
 *
 * The kernels are plain CUDA C++ with no torch headers, so they compile with bare
 * nvcc (tests/test_csrc_compile.py does so for sm_80 and sm_90) and could be
 * linked into a non-torch program. The torch binding (bindings.cpp) checks the
 * tensors and passes raw pointers and the current stream. Every function returns a
 * cudaError_t as int: 0 (cudaSuccess) or the launch error. This header is valid C.
 */
#ifndef MEGAFT_CUDA_H_
#define MEGAFT_CUDA_H_

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One fused AdamW step, in place, over n float32 elements of p, m (exp_avg) and v
 * (exp_avg_sq), with decoupled weight decay and bias correction; step counts from
 * 1. The hyperparameters come as doubles and the per-step scalars (bias
 * corrections, step size) are computed in double on the host, then rounded to
 * float once, as torch.optim.AdamW does with Python floats. Pointers may have any
 * alignment (16-byte aligned ones take the float4 path) and must not overlap. */
int megaft_adamw_fp32(float* p, const float* g, float* m, float* v, int64_t n,
                      int64_t step, double lr, double beta1, double beta2, double eps,
                      double weight_decay, cudaStream_t stream);

/* Element types of megaft_adamw_multi_tensor's params and grads (named apart from
 * megaft_kernels.h's megaft_dtype, so both headers can share a file). */
enum megaft_adamw_dtype { MEGAFT_ADAMW_FP32 = 0, MEGAFT_ADAMW_BF16 = 1 };

/* One fused AdamW step, in place, over num_tensors tensors of any sizes
 * (csrc/cuda/adamw_multi_tensor.cu): few launches for all of them. Tensor i has
 * numels[i] elements at params[i] (param_dtype), grads[i] (grad_dtype), exp_avgs[i]
 * and exp_avg_sqs[i] (float32), and its own steps[i] (from 1), lrs[i] and
 * weight_decays[i]; beta1, beta2 and eps are shared. With master_params == NULL the
 * params must be float32 and are updated in place; otherwise the update runs on the
 * float32 master_params[i] and params[i] receives it rounded to nearest even. The
 * host arrays are read before the function returns; device buffers must not
 * overlap. Returns cudaErrorInvalidValue for an unsupported dtype combination. */
int megaft_adamw_multi_tensor(int64_t num_tensors, void* const* params,
                              const void* const* grads, float* const* exp_avgs,
                              float* const* exp_avg_sqs, float* const* master_params,
                              const int64_t* numels, const int64_t* steps, const double* lrs,
                              const double* weight_decays, double beta1, double beta2,
                              double eps, int param_dtype, int grad_dtype, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MEGAFT_CUDA_H_ */
