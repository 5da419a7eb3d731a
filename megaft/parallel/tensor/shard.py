"""How a parameter is split over tensor-parallel ranks.

Each sharded parameter carries a TPShard: the dim it is split on, its true size
there and the padded size (a multiple of tp; the vocabulary may need padding).
Initialization, Hugging Face import/export and grad-norm clipping all read it, so
the full tensor <-> local shard mapping lives in one place.

A routed expert weight under expert parallelism (`parallel.ep`) also carries an
ExpertSlice: the experts (dim 0 of the stacked [E, ...] weight) its ep rank holds.
`full_shape` and `local_from_full` apply both splits, experts first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class TPShard:
    dim: int  # tensor dim split across tp ranks
    full: int  # true size along `dim` (e.g. the tokenizer's vocabulary)
    padded: int  # size along `dim` after padding; divisible by tp

    def bounds(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """[start, end) of this rank's rows in the padded tensor."""
        local = self.padded // tp_size
        return tp_rank * local, (tp_rank + 1) * local

    def real_bounds(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """[start, end) of this rank's rows that exist in the full tensor (no padding)."""
        start, end = self.bounds(tp_rank, tp_size)
        return min(start, self.full), min(end, self.full)


@dataclass(frozen=True)
class ExpertSlice:
    """Experts [rank * local, (rank + 1) * local) of `experts`, held by ep rank `rank` of `size`;
    `group`: the ep group (to gather the whole weight)."""
    rank: int
    size: int
    experts: int
    group: object = field(default=None, compare=False)

    @property
    def bounds(self) -> tuple[int, int]:
        local = self.experts // self.size
        return self.rank * local, (self.rank + 1) * local


def mark_expert_slice(param: torch.nn.Parameter, rank: int, size: int, experts: int, group) -> torch.nn.Parameter:
    param._expert_slice = ExpertSlice(rank, size, experts, group)
    return param


def expert_slice_of(param: torch.Tensor) -> Optional[ExpertSlice]:
    """The ExpertSlice of a routed expert weight split over ep > 1 ranks, else None."""
    return getattr(param, "_expert_slice", None)


def mark_sharded(param: torch.nn.Parameter, dim: int, full: int, padded: int) -> torch.nn.Parameter:
    param._tp_shard = TPShard(dim, full, padded)
    return param


def mark_sequence_parallel(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A replicated parameter applied to sequence shards: its grads are partial per
    rank and must be summed over tp (see megaft.parallel.tensor.grads)."""
    param._sequence_parallel = True
    return param


def shard_of(param: torch.Tensor) -> Optional[TPShard]:
    return getattr(param, "_tp_shard", None)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "_sequence_parallel", False)


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the unsharded, unpadded tensor of `param`."""
    spec = shard_of(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.full
    experts = expert_slice_of(param)
    if experts is not None:
        shape[0] = experts.experts
    return tuple(shape)


def local_from_full(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Cut this rank's shard out of `full` (its experts, then its tp rows), zero-filling padding rows."""
    experts = expert_slice_of(param)
    if experts is not None:
        lo, hi = experts.bounds
        full = full[lo:hi]
    spec = shard_of(param)
    if spec is None:
        return full
    start, end = spec.bounds(tp_rank, tp_size)
    rstart, rend = spec.real_bounds(tp_rank, tp_size)
    local = full.new_zeros(param.shape)
    local.narrow(spec.dim, 0, rend - rstart).copy_(full.narrow(spec.dim, rstart, rend - rstart))
    return local


def real_part(local: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The rows of a local shard that exist in the full tensor (padding dropped)."""
    spec = shard_of(param)
    if spec is None:
        return local
    rstart, rend = spec.real_bounds(tp_rank, tp_size)
    return local.narrow(spec.dim, 0, rend - rstart)
