"""Key/value heads when tensor parallelism is wider than them (tp > n_kv_heads).

Each rank keeps the one kv head its query heads read (kv head rank // replicas, with
replicas = tp / n_kv_heads), as Megatron and vLLM do. The copies must stay identical,
so the k/v weights (and biases) enter the GEMM through `replica_sum`: identity forward;
backward all-gathers the weight gradient over tp and gives every copy the sum over the
ranks sharing its head, in rank order (the same bits on every copy). That sum is the
full gradient of the head: each rank's share comes from its own query heads. The input
gradient needs nothing more: copy_to_tp already sums it over tp.

`ReplicatedShard` describes such a parameter to init, HF import/export and checkpoints:
the full tensor has n_kv_heads * head_dim rows and rank r holds those of head r // replicas.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megaft.parallel.comm import Group, all_gather, group_rank, group_size
from megaft.parallel.tensor.shard import TPShard


@dataclass(frozen=True)
class ReplicatedShard(TPShard):
    replicas: int = 1  # tp ranks holding each block of rows (padded == full: no padding)

    def bounds(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        local = self.full * self.replicas // tp_size
        start = (tp_rank // self.replicas) * local
        return start, start + local

    def real_bounds(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        return self.bounds(tp_rank, tp_size)


def local_rows(spec: TPShard, tp_size: int) -> int:
    """Rows (along spec.dim) one rank holds of a sharded parameter."""
    if isinstance(spec, ReplicatedShard):
        return spec.full * spec.replicas // tp_size
    return spec.padded // tp_size


def mark_replicated(param: nn.Parameter, full: int, replicas: int) -> nn.Parameter:
    """Mark a k/v weight or bias (rows = dim 0) as one head of `full` rows, held by `replicas` ranks."""
    param._tp_shard = ReplicatedShard(0, full, full, replicas)
    return param


def dedupe_gathered(gathered: torch.Tensor, spec: ReplicatedShard, tp_size: int) -> torch.Tensor:
    """The tp all-gather of a replicated parameter -> each head once (its first copy)."""
    local = local_rows(spec, tp_size)
    heads = tp_size // spec.replicas
    return torch.cat([gathered.narrow(spec.dim, h * spec.replicas * local, local) for h in range(heads)], spec.dim)


class _ReplicaSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, group: Group, replicas: int) -> torch.Tensor:
        ctx.group, ctx.replicas = group, replicas
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        every = all_gather(grad.contiguous().unsqueeze(0), 0, ctx.group)  # [tp, *shape]
        first = group_rank(ctx.group) // ctx.replicas * ctx.replicas
        total = every[first]
        for r in range(first + 1, first + ctx.replicas):  # fixed order: identical sums on every copy
            total = total + every[r]
        return total, None, None


def replica_sum(w: torch.Tensor, group: Group, replicas: int) -> torch.Tensor:
    """`w` for the forward; its gradient summed over the `replicas` ranks sharing it."""
    if w is None or replicas == 1 or group_size(group) == 1:
        return w
    return _ReplicaSum.apply(w, group, replicas)
