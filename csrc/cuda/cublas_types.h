// megaft_dtype -> cuBLAS's cudaDataType_t, shared by the cuBLAS (wgrad.cu) and cuBLASLt
// (linear_epilogue.cu) callers. Include after the cuBLAS header that defines the types.
#pragma once

#include "megaft_kernels.h"  // megaft_dtype

static inline bool megaft_cublas_type(megaft_dtype type, cudaDataType_t* out) {
  switch (type) {
    case MEGAFT_F32: *out = CUDA_R_32F; return true;
    case MEGAFT_F16: *out = CUDA_R_16F; return true;
    case MEGAFT_BF16: *out = CUDA_R_16BF; return true;
    default: return false;
  }
}
