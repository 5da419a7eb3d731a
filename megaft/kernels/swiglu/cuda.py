"""SwiGLU over megaft._cuda's ``torch.ops.megaft.swiglu_{fwd,bwd}`` (csrc/cuda/swiglu.cu),
with autograd here. The front checks availability (megaft.kernels.dispatch) first."""

from __future__ import annotations

import torch


class SwiGLUFunction(torch.autograd.Function):
    """swiglu(gate, up) = silu(gate) * up."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.ops.megaft.swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return torch.ops.megaft.swiglu_bwd(dy, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)
