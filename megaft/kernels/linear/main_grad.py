"""What the fused linears accumulate into: the main grad (FlatParams' persistent .grad view)
and the compute dtype. A leaf of the linear family, shared by the fused front and the
Triton and CUDA backends (see megaft.kernels.linear.fused)."""
from __future__ import annotations

from typing import Optional

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """F.linear's compute dtype: the autocast dtype when autocast is on, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


# .grad dtypes the kernels accumulate into: fp32, and 16-bit grads of 16-bit weights
# (optim.master_weights' bf16 buffers; fp16 alike), rounded once per accumulation.
MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def main_grad(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The buffer (fp32, or the 16-bit weight's own dtype) the weight gradient can be
    accumulated into, or None."""
    if not weight.is_leaf:  # a view or cast of a parameter: autograd owns its gradient
        return None
    g = weight.grad
    if g is None or g.dtype not in MAIN_GRAD_DTYPES or g.shape != weight.shape or not g.is_contiguous():
        return None
    # torch refuses a .grad of another dtype than the param's; checked here all the same,
    # since the zero placeholder _weight_grad hands autograd must match both
    return g if g.dtype == weight.dtype else None
