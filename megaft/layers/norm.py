"""RMSNorm (Zhang & Sennrich 2019) as Llama and Hugging Face compute it, through the
kernel front megaft.kernels.rmsnorm (torch reference, Triton or CUDA C++)."""
from __future__ import annotations

import torch
from torch import nn

from megaft.kernels.rmsnorm import rmsnorm
from megaft.parallel.comm import Group, all_reduce, group_size
from megaft.parallel.tensor.comm import copy_to_tp
from megaft.parallel.tensor.shard import mark_sequence_parallel, mark_sharded


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + w), computed in fp32 and cast back (HF LlamaRMSNorm's order).

    `offset` is 0 for Llama; Gemma stores w - 1 and scales by (1 + w) (offset 1): the
    sum is formed in the weight's dtype and handed to the same kernel, so every backend
    serves both and the gradient reaches w unchanged. (Gemma multiplies before casting
    back to a 16-bit input dtype; in fp32 the two orders are the same numbers.)
    `backend` is the kernel front's (auto | torch | triton | cuda); called with a
    `residual`, the pre-norm residual add is fused in front and (norm(x + residual),
    x + residual) is returned.

    `group`: the weight is shared by the heads of every tp rank (Qwen3's q/k norms over
    head_dim): each rank's gradient is partial, so the weight enters through
    copy_to_tp, whose backward sums it over the group (Megatron's f on a weight)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, sequence_parallel: bool = False, backend: str = "torch",
                 offset: float = 0.0, group: Group = None):
        super().__init__()
        self.eps, self.backend, self.offset, self.group = eps, backend, offset, group
        self.weight = nn.Parameter(torch.ones(dim))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight = self.weight if self.group is None else copy_to_tp(self.weight, self.group)
        weight = weight + self.offset if self.offset else weight
        return rmsnorm(x, weight, self.eps, self.backend, residual=residual)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward is also the sum: every rank's output feeds that
    rank's own computation, so each input's gradient gathers all ranks' parts."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class WidthRMSNorm(nn.Module):
    """RMSNorm over a projection split by columns over tp (OLMoE's q_norm / k_norm over all
    heads at once): the sum of squares is added over the ranks, each rank scales its slice
    with its slice of the weight (sharded like the projection's rows). HF OlmoeRMSNorm's
    order: fp32 statistics, cast back, then times the weight."""

    def __init__(self, width: int, *, eps: float, group: Group = None):
        super().__init__()
        tp = group_size(group)
        self.eps, self.group, self.width = eps, group, width
        self.weight = mark_sharded(nn.Parameter(torch.ones(width // tp)), 0, width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.square().sum(-1, keepdim=True)
        if group_size(self.group) > 1:
            squares = _SumOverRanks.apply(squares, self.group)
        return self.weight * (xf * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)
