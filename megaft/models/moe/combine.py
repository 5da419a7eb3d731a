"""The weighted sum of each token's k expert outputs (the MoE combine), in fp32.

Autograd's `(y.float() * w).sum(1)` would keep the fp32 copy of `y` [tokens × k × dim] for
the routing weights' gradient: twice the bytes of `y` itself under bf16. `combine` keeps `y`
in its compute dtype and the fp32 weights instead and recasts `y` in backward: the same
values (the cast is exact), so the same forward and gradients bit for bit.
"""
from __future__ import annotations

import torch


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, w)
        return (y.float() * w.unsqueeze(-1)).sum(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, w = ctx.saved_tensors
        g = grad.unsqueeze(1)  # the sum's backward: grad broadcast over the k slots
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = (g * w.unsqueeze(-1)).to(y.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g * y.float()).sum(-1).to(w.dtype)
        return grad_y, grad_w


def combine(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_j y[:, j] * w[:, j] in fp32, for `y` [tokens, k, dim] (any dtype) and `w` [tokens, k]."""
    return _Combine.apply(y, w)
