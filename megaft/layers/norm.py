"""RMSNorm (Zhang & Sennrich 2019) as Llama and Hugging Face compute it, through the
kernel front megaft.kernels.rmsnorm (torch reference, Triton or CUDA C++)."""
from __future__ import annotations

import torch
from torch import nn

from megaft.kernels.rmsnorm import rmsnorm
from megaft.layers.shard import mark_sequence_parallel


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in fp32 and cast back (HF LlamaRMSNorm's order).

    `backend` is the kernel front's (auto | torch | triton | cuda); called with a
    `residual`, the pre-norm residual add is fused in front and (norm(x + residual),
    x + residual) is returned."""

    def __init__(self, dim: int, *, eps: float = 1e-5, sequence_parallel: bool = False, backend: str = "torch"):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.ones(dim))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rmsnorm(x, self.weight, self.eps, self.backend, residual=residual)
