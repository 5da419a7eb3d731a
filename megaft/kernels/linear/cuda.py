"""The parallel linears' CUDA C++ backend: the fp32 weight-gradient accumulation
(Megatron's fused_weight_gradient_mlp_cuda) over megaft._cuda's
``torch.ops.megaft.wgrad_accumulate`` (csrc/cuda/wgrad.cu: one cublasGemmEx, fp32
compute, beta = 1 into the fp32 main grad, on torch's cuBLAS handle and stream).

The forward of this backend is torch's (F.linear, then the epilogue): cuBLAS is what
F.linear runs anyway, and the fusion this backend adds is the backward's wgrad into the
main grad (megaft.kernels.linear.fused with backend "cuda"). Availability is checked by
the caller (megaft.kernels.dispatch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _ops():
    # Looked up per call: the op exists only once megaft._cuda is imported (dispatch does).
    return torch.ops.megaft


def gemm(x2: torch.Tensor, w: torch.Tensor, bias=None, residual=None) -> torch.Tensor:
    """``x2 @ w.T (+ bias) (+ residual)`` as the torch path computes it (same rounding)."""
    y = F.linear(x2, w, bias)
    return y if residual is None else residual + y


def wgrad_accumulate_(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """main_grad[N, K] (fp32, contiguous) += dy[..., N].T @ x[..., K] in one cuBLAS call;
    dy and x must share a dtype (fp32, fp16 or bf16)."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    if main_grad.dtype != torch.float32 or main_grad.shape != (dy2.shape[1], x2.shape[1]):
        raise ValueError(f"main_grad must be fp32 [{dy2.shape[1]}, {x2.shape[1]}], got "
                         f"{main_grad.dtype} {tuple(main_grad.shape)}")
    if dy2.dtype != x2.dtype:
        raise ValueError(f"dy and x must share a dtype, got {dy2.dtype} and {x2.dtype}")
    _ops().wgrad_accumulate(main_grad, dy2, x2)
    return main_grad
