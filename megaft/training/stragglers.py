"""Straggler report: every `train.straggler_every` steps, all ranks share their step time.

One all_gather of a single float per rank (and, once, of the host names) over the
world: cheap next to a training step. The metrics line of that step gains
`step_time_min`, `step_time_median` and `step_time_max` (seconds, over ranks), and a
rank slower than the median times `train.straggler_factor` is named with its host and
grid coordinates in a warning (stderr of rank 0, and `stragglers` in the metrics
line). A slow rank holds every other rank up at the next collective, so the step time
measured here is the rank's own work before that wait: the trainer passes the time
from the start of the step to the end of its forward/backward compute.
"""
from __future__ import annotations

import logging
import socket
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

from megaft.parallel.grid import ParallelGrid

log = logging.getLogger("megaft")


class StragglerMonitor:
    """Gathers per-rank step times every `every` steps (0 = off); `observe` returns the metrics to log."""

    def __init__(self, grid: ParallelGrid, every: int, factor: float):
        self.grid, self.every, self.factor = grid, every, factor
        self.hosts: list[str] = []

    def _host_names(self) -> list[str]:
        if not self.hosts:
            if self.grid.world_size == 1:
                self.hosts = [socket.gethostname()]
            else:
                self.hosts = [""] * self.grid.world_size
                dist.all_gather_object(self.hosts, socket.gethostname())
        return self.hosts

    def _coords(self, rank: int) -> str:
        return " ".join(f"{k}={v}" for k, v in self.grid.coords_of(rank).items())

    def observe(self, step: int, seconds: float) -> dict[str, Any]:
        """After step `step` (1-based): this rank's `seconds`; every rank calls it at every step."""
        if not self.every or step % self.every:
            return {}
        hosts = self._host_names()
        mine = torch.tensor([seconds], dtype=torch.float64, device=self.grid.device)
        if self.grid.world_size > 1:
            times_t = [torch.zeros_like(mine) for _ in range(self.grid.world_size)]
            dist.all_gather(times_t, mine)
            times = [float(t.item()) for t in times_t]
        else:
            times = [seconds]
        median = statistics.median(times)
        out: dict[str, Any] = {"step_time_min": min(times), "step_time_median": median, "step_time_max": max(times)}
        slow = [r for r, t in enumerate(times) if t > median * self.factor]
        if slow:
            out["stragglers"] = slow
            if self.grid.rank == 0:
                names = "; ".join(f"rank {r} on {hosts[r]} ({self._coords(r)}): {times[r]:.3f}s" for r in slow)
                msg = (f"megaft: straggler(s) at step {step}: {names}, median {median:.3f}s "
                       f"(train.straggler_factor={self.factor:g})")
                log.warning(msg)
                print(msg, file=sys.stderr, flush=True)
        return out
