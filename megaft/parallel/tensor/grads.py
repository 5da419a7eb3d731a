"""Sequence-parallel gradient sync over tp after backward (the dp reduction: megaft.parallel.data.buckets)."""
from __future__ import annotations

import torch

from megaft.parallel.comm import Group, all_reduce, group_size
from megaft.parallel.tensor.shard import is_sequence_parallel


@torch.no_grad()
def sync_sequence_parallel_grads(params: list[torch.nn.Parameter], tp_group: Group) -> None:
    """Sum the partial grads of replicated params applied to sequence shards (norm
    weights, row biases) over tp, with one coalesced all-reduce (as Megatron does)."""
    grads = [p.grad for p in params if is_sequence_parallel(p) and p.grad is not None]
    if not grads or group_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])  # fp32 sum also for bf16 grads (master_weights)
    all_reduce(flat, tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()

