"""Measured pipeline step times: the real `PipelineRuntime` on CPU gloo ranks whose
stages have a fixed cost, next to the simulator and the formula.

A stage is a stand-in with a known duration per virtual stage: forward f/v and
backward b/v (a rank's whole slice costs f + b per micro-batch, as
`Cost.per_chunk` assumes). Two ways to spend that time:

* `sleep` (default): the rank waits a fixed time, the way a host waits on a GPU
  kernel. Ranks do not compete for cores, so p ranks run in parallel on any machine.
* `matmul`: a chain of 1-thread matmuls calibrated to the same duration. Needs at
  least p free cores, or ranks time-share and the measured bubble means nothing.

measured bubble = 1 - ideal / measured, where measured is the step time (slowest
rank, median of the timed steps) and ideal is the time the rank was not blocked on
a peer (its step time minus the runtime's `wait_s`, averaged over ranks): the
runtime's own per-action overhead counts as work, as it would on a GPU host, so
a loaded machine slows every action without inflating the bubble. `--ideal compute`
uses the stages' F/B time alone instead (overhead then counts as bubble).
The simulator's and the formula's columns are the same share of the total time,
1 - C / (p T): the simulator with nominal costs and free p2p, and the formula
(p-1)/(m+p-1) for GPipe/1F1B, r/(1+r) with r = (p-1)/(v m) for interleaved. A
second simulator column replays the schedule with the costs the ranks really had
(nominal f and b times the measured cost scale: per-action overhead, oversleep)
and the measured one-way p2p latency.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.ranks import on_gloo_ranks
from megaft.parallel.grid import ParallelGrid
from megaft.pipeline import Cost, build_schedule, simulate
from megaft.pipeline.runtime import PipelineRuntime

SEQ, DIM = 16, 64  # activation [1, SEQ, DIM] fp32: 4 KiB per message, p2p is nearly free


class _Busy:
    """Spends a given number of seconds (sleep or calibrated matmuls) and keeps the total."""

    def __init__(self, mode: str):
        self.mode, self.total = mode, 0.0
        self.a = torch.randn(128, 128)
        self.per_matmul = self._calibrate() if mode == "matmul" else 0.0

    def _calibrate(self) -> float:
        for _ in range(20):
            self.a @ self.a
        t0 = time.perf_counter()
        for _ in range(200):
            self.a @ self.a
        return (time.perf_counter() - t0) / 200

    def __call__(self, seconds: float) -> None:
        t0 = time.perf_counter()
        if self.mode == "sleep":
            time.sleep(seconds)
        else:
            for _ in range(max(1, round(seconds / self.per_matmul))):
                self.a @ self.a
        self.total += time.perf_counter() - t0


class _Spend(torch.autograd.Function):
    """Identity whose forward and backward each spend a fixed time."""

    @staticmethod
    def forward(ctx, x, busy, fwd, bwd):
        busy(fwd)
        ctx.busy, ctx.bwd = busy, bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.busy(ctx.bwd)
        return grad, None, None, None


class FixedCostStages(torch.nn.Module):
    """Duck-typed `StageModel`: virtual stages rank, rank + p, ... with fixed costs."""

    def __init__(self, pp: int, pp_rank: int, vpp: int, forward_s: float, backward_s: float, busy: _Busy):
        super().__init__()
        self.stages = list(range(pp_rank, pp * vpp, pp))
        self.last_stage = pp * vpp - 1
        self.fwd, self.bwd, self.busy = forward_s / vpp, backward_s / vpp, busy
        self.w = torch.nn.Parameter(torch.ones(()))

    def activation_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        return (batch, seq, DIM)

    def forward(self, stage: int, x: torch.Tensor, labels=None, docs=None) -> torch.Tensor:
        if stage == 0:
            x = self.w * torch.ones(x.shape + (DIM,))
        out = _Spend.apply(x, self.busy, self.fwd, self.bwd)
        return out.sum() if stage == self.last_stage else out


def _p2p_latency(grid: ParallelGrid, rounds: int = 30) -> float:
    """One-way gloo latency of one activation message, rank 0 <-> 1 (median round trip / 2)."""
    buf, times = torch.zeros(1, SEQ, DIM), []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if grid.rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif grid.rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - t0) / 2)
    latency = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.broadcast(latency, 0)
    return latency.item()


def _measure_case(grid: ParallelGrid, name: str, v: int, m: int, args) -> tuple[float, float, float]:
    """(step time, measured bubble, cost scale) of one schedule: slowest rank, median
    over steps. Cost scale = a rank's unblocked time / its nominal compute m (f + b):
    how much slower than nominal every action really ran (overhead, oversleep)."""
    busy = _Busy(args.stage) if args.stage == "sleep" else args.busy
    model = FixedCostStages(grid.pp_size, grid.pp_rank, v, args.forward_ms / 1e3, args.backward_ms / 1e3, busy)
    runtime = PipelineRuntime(model, grid, name, m, v)
    inputs = [torch.zeros(1, SEQ, dtype=torch.long) for _ in range(m)]
    steps, bubbles, scales = [], [], []
    for i in range(args.repeats + 1):  # the first step warms up gloo's pairs
        busy.total = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        runtime.train_step(inputs, inputs, 1, contextlib.nullcontext)
        took = time.perf_counter() - t0
        work = busy.total if args.ideal == "compute" else took - runtime.wait_s
        elapsed = torch.tensor([took, work], dtype=torch.float64)
        dist.all_reduce(elapsed[:1], op=dist.ReduceOp.MAX)  # the step ends with the slowest rank
        dist.all_reduce(elapsed[1:], op=dist.ReduceOp.SUM)
        model.w.grad = None
        if i:
            steps.append(elapsed[0].item())
            bubbles.append(1 - elapsed[1].item() / grid.pp_size / elapsed[0].item())
            scales.append(elapsed[1].item() / grid.pp_size / (m * (args.forward_ms + args.backward_ms) / 1e3))
    return statistics.median(steps), statistics.median(bubbles), statistics.median(scales)


def _rank(rank: int, world: int, cases, args) -> dict:
    grid = ParallelGrid.build(tp=1, dp=1, pp=world, device="cpu")
    if args.stage == "matmul":
        args.busy = _Busy("matmul")
    latency = _p2p_latency(grid)
    return {(name, world, v, m): _measure_case(grid, name, v, m, args) + (latency,) for name, v, m in cases}


def measure(p: int, cases, args) -> dict:
    """{(name, p, v, m): (step s, measured bubble, cost scale, p2p latency s)} for
    `cases` = [(name, v, m)] on p ranks."""
    return on_gloo_ranks(p, _rank, cases, args)


def simulated(name: str, p: int, v: int, m: int, forward: float, backward: float, p2p: float = 0.0) -> float:
    """The simulator's bubble share of the total time (costs and p2p latency in one unit)."""
    return simulate(build_schedule(name, p, m, v), p, Cost.per_chunk(v, forward, backward, p2p)).bubble_fraction
