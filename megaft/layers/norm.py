"""RMSNorm (Zhang & Sennrich 2019) as Llama and Hugging Face compute it."""
from __future__ import annotations

import torch
from torch import nn

from megaft.layers.shard import mark_sequence_parallel


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in fp32 and cast back (HF LlamaRMSNorm's order)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
