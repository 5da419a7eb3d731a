"""RoPE over megaft._cuda's ``torch.ops.megaft.rope_fwd`` (csrc/cuda/rope.cu), out of
place, with autograd here: the gradient is the rotation by the negative angle, the
same kernel with ``backward=True``. The front checks availability first."""

from __future__ import annotations

import torch


class RoPEFunction(torch.autograd.Function):
    """(rope(q), rope(k))."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return torch.ops.megaft.rope_fwd(q, k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = torch.ops.megaft.rope_fwd(dq, dk, cos, sin, True)
        return dq, dk, None, None


def rope(q, k, cos, sin):
    return RoPEFunction.apply(q, k, cos, sin)
