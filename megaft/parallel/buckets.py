"""Bucketed data-parallel gradient reduction, launched from autograd hooks during backward.

FlatParams cuts its gradient buffers into buckets (`parallel.bucket_mb`). A
post-accumulate-grad hook on every parameter counts the parameters of its bucket
that are ready; when a bucket is complete its collective is launched with
async_op=True, so it runs while backward computes the earlier layers' gradients
(PyTorch DDP's reducer, Li et al. 2020). `finish()` launches what is left (unused
parameters, or every bucket when hooks are off) and waits on all handles; clipping
and the optimizer run after it.

Buckets are launched in bucket order on every rank, never out of order: collectives
on one group must be issued in the same order everywhere, and backward visits the
same graph on every dp rank.

Modes (`parallel.zero`):
  0  all-reduce each bucket in place; only on the last micro-batch (`arm()`), so
     accumulation micro-steps communicate nothing and each step reduces once.
  1  reduce-scatter each bucket on the last micro-batch; the rank's chunk of the
     sum is copied into its chunk of the bucket (the only part the optimizer reads).
  2  no full gradient buffer: the hook moves each `.grad` into a bucket-sized
     scratch buffer and frees it; a complete bucket is reduce-scattered and added
     to the rank's shard, on every micro-batch (as DeepSpeed ZeRO-2 does: the full
     gradient is never kept across micro-batches), then the scratch is freed.
Every mode sums: each rank's loss is divided by the global batch's target count,
so the dp sum is the exact token-weighted mean gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megaft.optim.flat import Bucket, FlatParams
from megaft.parallel.comm import Group, group_rank, group_size

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk_range(bucket: Bucket, dp: int, dp_rank: int) -> tuple[int, int]:
    """[lo, hi) of this rank's chunk of `bucket` in its group's buffer."""
    size = bucket.numel // dp
    lo = bucket.start + dp_rank * size
    return lo, lo + size


class GradReducer:
    """Reduces FlatParams' gradients over dp; see the module docstring for the modes.

    `chunk_grads[i]` (zero >= 1) is where bucket i's reduced chunk goes: a view into
    the full gradient buffer (zero 1) or into the rank's shard buffer (zero 2).
    `overlap=False` installs no hooks for zero 0/1: everything is reduced in
    `finish()`, after backward (the benchmark's baseline)."""

    def __init__(self, flat: FlatParams, dp_group: Group, *, zero: int = 0,
                 chunk_grads: Optional[list[torch.Tensor]] = None, overlap: bool = True):
        self.flat, self.group, self.zero = flat, dp_group, zero
        self.dp, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.buckets = flat.buckets
        self.chunk_grads = chunk_grads
        self._index = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._offset = {id(p): off for b in self.buckets for p, off in zip(b.params, b.offsets)}
        self._seen: list[set[int]] = [set() for _ in self.buckets]
        self._scratch: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self._next = 0  # the next bucket to launch: launches stay in bucket order
        # (work, bucket, reduced chunk or None, the bucket's input kept alive until the wait)
        self._pending: list[tuple[Optional[dist.Work], int, Optional[torch.Tensor], torch.Tensor]] = []
        self.armed = zero == 2  # zero 2 reduces every micro-batch
        self.after_finish = None  # called at the end of finish() (ZeRO-3 releases layers left gathered)
        self._hooks = []
        if overlap or zero == 2:
            self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for b in self.buckets for p in b.params]

    def arm(self) -> None:
        """Reduce during the coming backward (call before the last micro-batch's)."""
        self.armed = True

    def _hook(self, p: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        i = self._index[id(p)]
        if self.zero == 2:
            self._stash(p, i)
        self._seen[i].add(id(p))
        while self._next < len(self.buckets) and len(self._seen[self._next]) == len(self.buckets[self._next].params):
            self._launch(self._next)
            self._next += 1
        if self.zero == 2 and self._next == len(self.buckets):
            self._next = 0  # the next micro-batch's round

    @torch.no_grad()
    def _stash(self, p: torch.nn.Parameter, i: int) -> None:
        """zero 2: add p's gradient into bucket i's scratch and free it."""
        b = self.buckets[i]
        if self._scratch[i] is None:
            self._scratch[i] = torch.zeros(b.numel, dtype=torch.float32, device=p.device)
        off = self._offset[id(p)] - b.start
        self._scratch[i][off:off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None

    def _bucket_grad(self, i: int) -> torch.Tensor:
        b = self.buckets[i]
        if self.zero == 2:
            scratch = self._scratch[i]
            if scratch is None:  # no gradient arrived (an unused bucket): reduce zeros, as every rank does
                scratch = torch.zeros(b.numel, device=self.flat.groups[b.group].data.device)
            return scratch
        return self.flat.groups[b.group].grad[b.start:b.stop]

    def _launch(self, i: int) -> None:
        grad = self._bucket_grad(i)
        self._seen[i].clear()
        self._scratch[i] = None
        if self.zero == 0:
            work = dist.all_reduce(grad, group=self.group, async_op=True) if self.dp > 1 else None
            self._pending.append((work, i, None, grad))
            return
        size = grad.numel() // self.dp
        if self.dp == 1:
            self._pending.append((None, i, grad, grad))
            return
        out = torch.empty(size, dtype=grad.dtype, device=grad.device)
        work = _reduce_scatter(out, grad, group=self.group, async_op=True)
        self._pending.append((work, i, out, grad))

    @torch.no_grad()
    def finish(self) -> None:
        """Launch every bucket not launched yet (in order), wait for all, and land the chunks."""
        if self.zero == 2:
            for k in range(len(self.buckets)):  # partly filled buckets, from where the round stopped
                i = (self._next + k) % len(self.buckets)
                if self._scratch[i] is not None:
                    self._launch(i)
            self._next = 0
        else:
            for i in range(self._next, len(self.buckets)):
                self._launch(i)
            self._next = 0
            self.armed = False
        for work, i, out, _ in self._pending:
            if work is not None:
                work.wait()
            if out is not None:
                if self.zero == 1:
                    self.chunk_grads[i].copy_(out)
                else:
                    self.chunk_grads[i].add_(out)
        self._pending = []
        if self.after_finish is not None:
            self.after_finish()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
