"""Autograd-aware tensor-parallel collectives, named by their forward/backward pair.

Megatron's conjugate operators (Shoeybi et al. 2019, Fig. 3): `f` is
copy_to_tp (identity forward, all-reduce backward) and `g` is reduce_from_tp
(all-reduce forward, identity backward). The sequence-parallel pair (Korthikanti
et al. 2022) replaces all-reduce with all-gather / reduce-scatter along the
sequence dimension. A None group or a group of size 1 is an identity fast path.
"""
from __future__ import annotations

import torch

from megaft.parallel.comm import Group, all_gather, all_reduce, group_size, reduce_scatter, split


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.dim, ctx.group), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        # contiguous: the layers sharing this input (q/k/v, gate/up) then save one tensor for
        # backward, not one reshaped copy each
        return all_gather(x, dim, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        # Each rank's downstream grad is a partial sum (column-parallel input).
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` forward, keep own chunk of the gradient backward."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, dim % x.dim(), group)


def scatter_to_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep own chunk along `dim` forward, all-gather the gradient backward."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, dim % x.dim(), group)


def gather_from_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallel: all-gather the sequence forward, reduce-scatter backward."""
    return x if group_size(group) == 1 else _GatherFromSP.apply(x, dim % x.dim(), group)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallel: reduce-scatter along the sequence forward, all-gather backward."""
    return x if group_size(group) == 1 else _ReduceScatterToSP.apply(x, dim % x.dim(), group)


def scatter_to_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallel: keep own sequence chunk forward, all-gather backward."""
    return scatter_to_tp(x, group, dim)
