"""SwiGLU's activation in torch: the specification the other backends are tested
against. ``silu(gate) * up`` as megaft's MLP computes it (both in the input dtype;
torch evaluates silu in fp32 internally and rounds once). Backward is autograd's."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` elementwise; ``gate`` and ``up`` have one shape and dtype."""
    return F.silu(gate) * up
