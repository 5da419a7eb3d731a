"""Timing collectives over a scope's process groups, every result checked exactly.

Every buffer is float32 and holds small integers, so every collective's result is known
exactly and compared with torch.equal after every iteration, warm-up included: a wrong
result is recorded as an error of that row, never as a bandwidth. Outputs are filled
with SENTINEL before each call, so a collective that wrote nothing is caught too.

Values: element j of a routed buffer (all-gather, all-to-all, broadcast, send/recv) is
(j mod 61) + 64 x tag, where the tag names the sending rank and the iteration; reductions
add (j mod 61) + 1 + ((rank + iteration) mod 8) over the ranks. Both stay below 2^24, where
float32 holds every integer, for any world up to 2^17 ranks.

The expert-parallel all-to-all (EpCase) moves rows of a fixed width with split sizes
per destination; group rank i's send buffer is (j mod 61) + 64 x tag, and what a rank
receives from each source is that source's rows for it, checked the same way.

Timing of one iteration: a 1-element all-reduce over the group (all ranks start together),
then the collective, then torch.cuda.synchronize on GPU; perf_counter around the last two.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaft.commbench.busbw import elements
from megaft.commbench.hooks import Hooks
from megaft.config.commbench import Collective
from megaft.parallel.comm import all_gather_single, reduce_scatter_single

SENTINEL = -1.0
TAG_LIMIT = 1 << 17  # 64 * TAG_LIMIT + 61 < 2**24


def pattern(numel: int, device: torch.device) -> torch.Tensor:
    """(j mod 61) for j < numel, float32: the position part of every checked buffer."""
    return torch.arange(numel, dtype=torch.int32, device=device).remainder_(61).float()


def _tag(i: int, k: int, n: int) -> int:
    """Tag of group rank i's data at iteration k: distinct over the group, changes every iteration."""
    return (i + (k % 64) * n) % TAG_LIMIT


def mismatch(out: torch.Tensor, expected: torch.Tensor) -> Optional[str]:
    """None when equal, else where and how the first element differs."""
    expected = expected.expand_as(out)
    if torch.equal(out, expected):
        return None
    flat_out, flat_exp = out.reshape(-1), expected.reshape(-1)
    bad = (flat_out != flat_exp).nonzero()
    first = int(bad[0])
    return (f"{bad.numel()} of {flat_out.numel()} elements wrong, first at {first}: got {flat_out[first].item():g}, "
            f"expected {flat_exp[first].item():g}")


class Case:
    """One collective at one size in one group: buffers, one call, and its exact expected result."""

    def __init__(self, collective: str, nbytes: int, group: dist.ProcessGroup, members: list[int],
                 device: torch.device, hooks: Hooks):
        self.op, self.group, self.members, self.hooks = Collective(collective), group, members, hooks
        self.n, self.rank = len(members), dist.get_rank()
        self.me = members.index(self.rank)
        self.numel = elements(collective, nbytes, self.n)
        self.nbytes = self.numel * 4
        self.chunk = self.numel // self.n
        numel_in = self.chunk if self.op == Collective.all_gather else self.numel
        numel_out = self.chunk if self.op == Collective.reduce_scatter else self.numel
        self.base = pattern(self.numel, device)
        self.inp = torch.empty(numel_in, device=device)
        self.out = self.inp if self.op in (Collective.all_reduce, Collective.broadcast) else \
            torch.empty(numel_out, device=device)

    def prepare(self, k: int) -> None:
        """Fill this iteration's input and poison the output (outside the timed region)."""
        op, me, n = self.op, self.me, self.n
        if op in (Collective.all_reduce, Collective.reduce_scatter):
            self.inp.copy_(self.base).add_(1 + (me + k) % 8)
        elif op == Collective.broadcast and me != 0:
            self.inp.fill_(SENTINEL)
        else:  # routed data: all_gather sends the first chunk of the pattern
            self.inp.copy_(self.base[: self.inp.numel()]).add_(64 * _tag(me, k, n))
        if self.out is not self.inp:
            self.out.fill_(SENTINEL)

    def run(self) -> None:
        op, g = self.op, self.group
        if op == Collective.all_reduce:
            dist.all_reduce(self.inp, group=g)
        elif op == Collective.reduce_scatter:
            reduce_scatter_single(self.out, self.inp, group=g)
        elif op == Collective.all_gather:
            all_gather_single(self.out, self.inp, group=g)
        elif op == Collective.all_to_all:
            dist.all_to_all_single(self.out, self.inp, group=g)
        elif op == Collective.broadcast:
            dist.broadcast(self.inp, src=self.members[0], group=g)
        else:  # send_recv: a ring, every rank sends and receives at once (nccl-tests sendrecv_perf)
            dst, src = self.members[(self.me + 1) % self.n], self.members[(self.me - 1) % self.n]
            delay = self.hooks.delay(self.rank, dst)
            if delay:
                time.sleep(delay)
            ops = [dist.P2POp(dist.isend, self.inp, dst, g), dist.P2POp(dist.irecv, self.out, src, g)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    def expected(self, k: int) -> torch.Tensor:
        op, me, n, c = self.op, self.me, self.n, self.chunk
        if op in (Collective.all_reduce, Collective.reduce_scatter):
            total = self.base * n + (n + sum((i + k) % 8 for i in range(n)))
            return total if op == Collective.all_reduce else total[me * c:(me + 1) * c]
        tags = torch.tensor([64.0 * _tag(i, k, n) for i in range(n)], device=self.base.device)
        if op == Collective.all_gather:  # chunk i = rank i's input
            return (self.base[:c].view(1, c) + tags.view(n, 1)).reshape(-1)
        if op == Collective.all_to_all:  # chunk i = rank i's chunk `me`
            return (self.base[me * c:(me + 1) * c].view(1, c) + tags.view(n, 1)).reshape(-1)
        if op == Collective.broadcast:
            return self.base + tags[0]
        return self.base + tags[(me - 1) % n]  # send_recv: the previous rank's buffer

    def check(self, k: int) -> Optional[str]:
        if self.hooks.corrupt:
            self.hooks.corrupt(self.op.value, self.rank, self.out)
        return mismatch(self.out, self.expected(k))


class EpCase:
    """The ep all-to-all of one routing: `splits[i][j]` rows of `row_elems` float32 words from
    group rank i to group rank j, one all_to_all_single with split sizes (as
    megaft.parallel.expert.dispatch calls it)."""

    def __init__(self, collective: str, splits: list[list[int]], row_elems: int, group: dist.ProcessGroup,
                 members: list[int], device: torch.device, hooks: Hooks):
        self.op, self.group, self.hooks = collective, group, hooks
        self.n, self.rank = len(members), dist.get_rank()
        self.me = me = members.index(self.rank)
        self.send = list(splits[me])
        self.recv = [splits[i][me] for i in range(self.n)]
        self.base = pattern(sum(self.send) * row_elems, device).view(-1, row_elems)
        self.inp = torch.empty_like(self.base)
        self.out = torch.empty(sum(self.recv), row_elems, device=device)
        self.nbytes = self.inp.numel() * 4
        self.pieces = []  # (source i, the words i sends this rank, before i's tag): past its rows for ranks < me
        for i in range(self.n):
            first = sum(splits[i][:me]) * row_elems
            words = torch.arange(first, first + self.recv[i] * row_elems, dtype=torch.int64, device=device)
            self.pieces.append((i, words.remainder_(61).float()))
        self.sent_bytes = (sum(self.send) - self.send[me]) * row_elems * 4
        self.recv_bytes = (sum(self.recv) - self.recv[me]) * row_elems * 4

    def prepare(self, k: int) -> None:
        self.inp.copy_(self.base).add_(64 * _tag(self.me, k, self.n))
        self.out.fill_(SENTINEL)

    def run(self) -> None:
        dist.all_to_all_single(self.out, self.inp, self.recv, self.send, group=self.group)

    def expected(self, k: int) -> torch.Tensor:
        return torch.cat([piece + 64 * _tag(i, k, self.n) for i, piece in self.pieces])

    def check(self, k: int) -> Optional[str]:
        if self.hooks.corrupt:
            self.hooks.corrupt(self.op, self.rank, self.out)
        return mismatch(self.out.view(-1), self.expected(k))


def sync(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """All ranks of `group` (None: the world) leave together: a 1-element all-reduce."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iterations(step: Callable[[int], None], *, before: Callable[[int], None],
                    after: Callable[[int], Optional[str]], group, device: torch.device, warmup: int,
                    repeats: int) -> tuple[list[float], Optional[str]]:
    """(seconds of each timed iteration, the first error of any iteration)."""
    times, error = [], None
    for k in range(warmup + repeats):
        before(k)
        sync(group, device)
        t0 = time.perf_counter()
        step(k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if k >= warmup:
            times.append(dt)
        err = after(k)
        if err and error is None:
            error = f"iteration {k}: {err}"
    return times, error


def measure_collective(collective: str, nbytes: int, group, members: list[int], device: torch.device,
                       hooks: Hooks, *, warmup: int, repeats: int) -> dict:
    """This rank's record of one collective at one size: bytes as measured, times, first error."""
    case = Case(collective, nbytes, group, members, device, hooks)
    times, error = time_iterations(lambda k: case.run(), before=case.prepare, after=case.check, group=group,
                                   device=device, warmup=warmup, repeats=repeats)
    return {"collective": collective, "bytes": case.nbytes, "times": times, "error": error}


def measure_ep(collective: str, splits: list[list[int]], row_elems: int, group, members: list[int],
               device: torch.device, hooks: Hooks, *, warmup: int, repeats: int) -> dict:
    """This rank's record of one ep all-to-all: its send buffer's bytes, times, first error, the
    group's splits and the bytes this rank sent to and received from the others."""
    case = EpCase(collective, splits, row_elems, group, members, device, hooks)
    times, error = time_iterations(lambda k: case.run(), before=case.prepare, after=case.check, group=group,
                                   device=device, warmup=warmup, repeats=repeats)
    return {"collective": collective, "bytes": case.nbytes, "times": times, "error": error, "splits": splits,
            "sent_bytes": case.sent_bytes, "recv_bytes": case.recv_bytes}
