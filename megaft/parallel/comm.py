"""Process-group helpers and the plain collectives every axis uses (tp, cp, dp, pp).

`Group` is a process group or None; a None group or a group of size 1 is an identity
fast path everywhere. The autograd-aware collectives of tensor and sequence parallelism
(Megatron's f and g) are in megaft.parallel.tensor.comm.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

# torch >= 2.13 names the single-tensor collectives *_single; older releases (a
# system CUDA torch reused by the venv) only have the *_tensor spelling. Looked up at each
# call, so a wrapper installed on torch.distributed (megaft.launch.trace) sees these too.
def all_gather_single(out: torch.Tensor, x: torch.Tensor, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, **kwargs)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, **kwargs)


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: Group, op=None) -> torch.Tensor:
    """`x` reduced in place over `group` (a sum unless `op`, a dist.ReduceOp, says otherwise)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((n * x.shape[0],) + x.shape[1:])
    all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over ranks, keep this rank's chunk along `dim`."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    if x.shape[0] % n:
        raise ValueError(f"reduce_scatter: size {x.shape[0]} not divisible by {n} ranks")
    out = x.new_empty((x.shape[0] // n,) + x.shape[1:])
    reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


def split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's chunk of `x` along `dim`."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"split: size {x.shape[dim]} along dim {dim} not divisible by {n} ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()
