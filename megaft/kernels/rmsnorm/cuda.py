"""RMSNorm over megaft._cuda's ``torch.ops.megaft.rmsnorm_{fwd,bwd}`` (csrc/cuda/rmsnorm.cu),
with autograd here. The front checks availability (megaft.kernels.dispatch) first."""

from __future__ import annotations

import torch


class RMSNormFunction(torch.autograd.Function):
    """rmsnorm(x, weight, eps, residual) -> y, or (y, x + residual) when residual is given."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, h, rstd = torch.ops.megaft.rmsnorm_fwd(x, weight, residual, eps)
        ctx.fused = residual is not None
        ctx.save_for_backward(h if ctx.fused else x, weight, rstd)
        return (y, h.view(x.shape)) if ctx.fused else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        x, weight, rstd = ctx.saved_tensors
        if ctx.fused and dh is None:
            dh = torch.zeros_like(x)
        dx, dw = torch.ops.megaft.rmsnorm_bwd(dy, x, weight, rstd, dh if ctx.fused else None)
        return dx, dw, None, (dx if ctx.fused else None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
            residual: torch.Tensor | None = None):
    return RMSNormFunction.apply(x, weight, eps, residual)
