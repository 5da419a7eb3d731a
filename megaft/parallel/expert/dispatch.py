"""Token dispatch for expert parallelism: rows sorted by global expert go to the ep rank that
holds their expert, are computed there grouped by local expert, and come back in their order.

Split sizes vary per step, so each dispatch first exchanges the per-expert row counts (one
small all-to-all, then a host sync: the grouped GEMM and the row all-to-alls need them on
the host, as in Megatron's AlltoAll dispatcher). No row is dropped. Each row's result
depends on that row and its expert's weights alone, so the outputs equal the single
process's; expert weight gradients sum the same rows in another order.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megaft.parallel.comm import Group, group_size


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    """Rows [in_splits[0] for rank 0, in_splits[1] for rank 1, ...] of `x` sent; the rows
    received, out_splits[r] from rank r, in rank order (autograd-aware)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """For received rows laid out [source rank][local expert] with `counts` [ranks, experts]
    rows per block: the row indices in [local expert][source rank] order."""
    sizes = counts.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(counts)
    block_starts, block_sizes = starts.t().reshape(-1), counts.t().reshape(-1)
    first = torch.repeat_interleave(block_starts - (torch.cumsum(block_sizes, 0) - block_sizes), block_sizes)
    return first + torch.arange(int(sizes.sum()))


def dispatch_compute_combine(rows: torch.Tensor, counts: torch.Tensor, group: Group,
                             compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`rows` sorted by global expert, `counts` [n_experts] rows per expert (on rows' device;
    rows past their sum, dropped by a capacity, are not sent and have no result):
    each rank's rows go to the ep rank holding their experts (rank r holds experts
    [r E/ep, (r+1) E/ep)), `compute(local rows sorted by local expert, rows per local expert
    (int64, host))` runs there, and the results come back in `rows`' order."""
    ep = group_size(group)
    per_rank = counts.view(ep, -1)  # [destination rank, its local experts]
    received = torch.empty_like(per_rank)
    dist.all_to_all_single(received, per_rank.contiguous(), group=group)  # row counts: [source rank, local expert]
    both = torch.cat([per_rank, received]).cpu()  # one host sync for both
    send, recv = both[:ep], both[ep:]
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    got = all_to_all(rows[:sum(send_splits)], recv_splits, send_splits, group)
    order = _expert_major(recv).to(rows.device)
    out = compute(got[order], recv.sum(0))
    out = torch.empty_like(out).index_copy(0, order, out)  # back to [source rank][local expert]
    return all_to_all(out, send_splits, recv_splits, group)
