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

bf16 gradients (`optim.master_weights`) are reduced in fp32: each bucket is upcast for
its collective (zero 2's scratch is fp32 already) and the sum is rounded to bf16 once
where it lands, so no rounding per partial sum (Megatron reduces bf16 grads in fp32 too).

Routed experts split over ep (`FlatGroup.expert`) are reduced over `expert_group`, the
ranks holding the same experts, in the same bucket order as the rest.

Compression (`parallel.grad_compression`, megaft.parallel.data.compress): bf16 casts each
bucket for its collective (any mode); powersgd (zero 0/1) all-reduces each bucket's P
factors from the hook and its Q factors in `finish()`, then writes P Q^T back (zero 1
then keeps its chunk, as the reduce-scatter would have). With bf16 grads PowerSGD works
on an fp32 copy of the bucket (P, Q and the fp32 error feedback) and P Q^T is rounded to
bf16 once where it lands, as the uncompressed fp32 sum is. `sent_bytes` counts the
bytes of the collectives' inputs on this rank (the payload each rank contributes,
independent of the collective's algorithm: a ring all-reduce moves 2 (dp-1)/dp of it).
PowerSGD's state (Q's, error feedback, where the warm-up started) goes into checkpoints
(`compression_state`); megaft.checkpoint.state restores it or restarts it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaft.parallel.comm import Group, group_rank, group_size, reduce_scatter_single
from megaft.parallel.data.compress import COMPRESSIONS, PowerSGD
from megaft.parallel.data.flat import Bucket, FlatParams


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
    `finish()`, after backward (the benchmark's baseline). `compression`: none | bf16 |
    powersgd (rank `powersgd_rank`, plain fp32 for the first `powersgd_warmup_steps`
    steps, as Vogels et al. start from uncompressed steps). `clock()` gives the optimizer
    steps taken (restored on resume, so the warmup is not repeated unless the PowerSGD state is
    restarted, see `restart_compression`); default: finish() calls."""

    def __init__(self, flat: FlatParams, dp_group: Group, *, zero: int = 0,
                 chunk_grads: Optional[list[torch.Tensor]] = None, overlap: bool = True,
                 compression: str = "none", powersgd_rank: int = 2, powersgd_warmup_steps: int = 0,
                 clock: Optional[Callable[[], int]] = None, expert_group: Group = None):
        self.flat, self.group, self.zero = flat, dp_group, zero
        self.dp, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.buckets = flat.buckets
        # each bucket's reduction group: the expert replicas for routed experts split over ep
        self.groups = [expert_group if flat.groups[b.group].expert else dp_group for b in self.buckets]
        self.sizes = [group_size(g) for g in self.groups]
        self.chunk_grads = chunk_grads
        if compression not in COMPRESSIONS or (compression == "powersgd" and (zero > 1 or self.groups != [dp_group]
                                                                               * len(self.groups))):
            raise ValueError(f"grad_compression={compression!r} with zero={zero}: "
                             "use none|bf16, or powersgd at zero 0/1 without expert parallelism")
        self.compression, self.warmup = compression, powersgd_warmup_steps
        self.steps = 0  # finish() calls
        self.warmup_from = 0  # the step PowerSGD's warm-up counts from (moved by restart_compression)
        self.clock = clock or (lambda: self.steps)
        self.sent_bytes = 0  # bytes handed to collectives since the last take_sent_bytes()
        self.powersgd = None
        if compression == "powersgd" and self.dp > 1:
            device = flat.groups[0].data.device
            layout = [[(off - b.start, p.shape) for p, off in zip(b.params, b.offsets)] for b in self.buckets]
            self.powersgd = PowerSGD(layout, [b.numel for b in self.buckets], rank=powersgd_rank, dp=self.dp,
                                     device=device)
        self._index = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._offset = {id(p): off for b in self.buckets for p, off in zip(b.params, b.offsets)}
        self._seen: list[set[int]] = [set() for _ in self.buckets]
        self._scratch: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self._next = 0  # the next bucket to launch: launches stay in bucket order
        # (work, bucket, reduced chunk | None, the collective's input, the bucket's grad)
        self._pending: list[tuple] = []
        # PowerSGD: (work, bucket, the P's all-reduced, the fp32 bucket worked on, the bucket's grad)
        self._psgd: list[tuple] = []
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

    def _mode(self, i: int) -> str:
        if self.sizes[i] == 1:
            return "none"  # nothing is sent
        if self.compression == "powersgd" and self.clock() - self.warmup_from < self.warmup:
            return "none"
        return self.compression

    def _launch(self, i: int) -> None:
        grad = self._bucket_grad(i)
        self._seen[i].clear()
        self._scratch[i] = None
        mode, n, group = self._mode(i), self.sizes[i], self.groups[i]
        if mode == "powersgd":  # all-reduce the P's now, the Q's in finish()
            # bf16 grads: P, Q and the error feedback run on an fp32 copy of the bucket (fp32: in place)
            fp32 = grad.float()
            send = self.powersgd.begin(i, fp32)
            self.sent_bytes += sum(self.powersgd.wire_bytes(i))
            self._psgd.append((dist.all_reduce(send, group=self.group, async_op=True), i, send, fp32, grad))
            return
        # bf16 grads (optim.master_weights) are summed over dp in fp32 and rounded to bf16 once
        # when they land: no rounding per partial sum, so the result does not depend on dp
        wire = grad.to(torch.bfloat16) if mode == "bf16" else grad.float() if n > 1 else grad
        if n > 1:
            self.sent_bytes += wire.nbytes
        if self.zero == 0:
            work = dist.all_reduce(wire, group=group, async_op=True) if n > 1 else None
            self._pending.append((work, i, None, wire, grad))
            return
        if n == 1:
            self._pending.append((None, i, grad, grad, grad))
            return
        out = torch.empty(wire.numel() // n, dtype=wire.dtype, device=wire.device)
        work = reduce_scatter_single(out, wire, group=group, async_op=True)
        self._pending.append((work, i, out, wire, grad))

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
        self._finish_powersgd()
        for work, i, out, wire, grad in self._pending:
            if work is not None:
                work.wait()
            if out is None and wire is not grad:  # bf16 all-reduce: back into the fp32 bucket
                grad.copy_(wire)
            elif out is not None:
                if self.zero == 1:
                    self.chunk_grads[i].copy_(out)
                else:
                    self.chunk_grads[i].add_(out)
        self._pending = []
        self.steps += 1
        if self.after_finish is not None:
            self.after_finish()

    def _finish_powersgd(self) -> None:
        """Second PowerSGD round, in bucket order on every rank: P's summed -> Q's all-reduced,
        then P Q^T into each bucket; zero 1 keeps its chunk of the (full) sum. bf16 grads get
        the fp32 result rounded once, where it lands (the whole bucket, or zero 1's chunk)."""
        rounds = []
        for work, i, send, fp32, grad in self._psgd:
            work.wait()
            q = self.powersgd.middle(i, fp32, send)
            rounds.append((dist.all_reduce(q, group=self.group, async_op=True), i, send, q, fp32, grad))
        self._psgd = []
        for work, i, p, q, fp32, grad in rounds:
            work.wait()
            self.powersgd.end(i, fp32, p, q)
            if self.zero == 1:
                lo, hi = chunk_range(self.buckets[i], self.dp, self.dp_rank)
                start = self.buckets[i].start
                self.chunk_grads[i].copy_(fp32[lo - start:hi - start])
            elif fp32 is not grad:
                grad.copy_(fp32)

    def compression_state(self) -> Optional[dict]:
        """What a checkpoint keeps of the compression: PowerSGD's Q's and this rank's errors and
        the warm-up start; None when there is no state (none, bf16, dp=1)."""
        if self.powersgd is None:
            return None
        return {"powersgd": self.powersgd.state_dict(), "warmup_from": self.warmup_from}

    def load_compression_state(self, state: dict) -> None:
        """Restore a `compression_state()`; ValueError when it does not fit this run."""
        if self.powersgd is not None:
            self.powersgd.load_state_dict(state["powersgd"])
            self.warmup_from = int(state["warmup_from"])

    def restart_compression(self, step: int) -> None:
        """Fresh PowerSGD state (zero errors, initial Q's) whose warm-up starts again at `step`."""
        if self.powersgd is not None:
            self.powersgd.reset()
            self.warmup_from = step

    def take_sent_bytes(self) -> int:
        """Bytes sent since the last call (one optimizer step when called once a step)."""
        sent, self.sent_bytes = self.sent_bytes, 0
        return sent

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
