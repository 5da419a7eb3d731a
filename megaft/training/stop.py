"""Stopping together: a signal sets a flag, and ranks agree on it at step boundaries.

The handlers only set a flag: nothing is safe to do inside a signal handler while a
collective may be in flight. At every step boundary `StepBoundary.agree` combines
this rank's flag (and the async-save progress, megaft.checkpoint.writer) with ONE
all_reduce(MAX) over the world, so every rank stops after the same step; it works on
gloo and NCCL alike. The trainer then saves and returns; what happens to the job
after that (Slurm requeue) is the launcher's business (megaft.launch.preempt).

- SIGUSR1/SIGUSR2 (Slurm's time-limit warnings, megaft.signals.WARNING_SIGNALS): REQUEUE.
  During training this takes over submitit's own USR2 handler, so submitit jobs
  requeue exactly like sbatch ones.
- SIGTERM (scancel, Slurm's own preemption): STOP, without requeueing. A second
  SIGTERM kills the process at once (a rank stuck in a collective stays killable).
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

from megaft.signals import STOP_SIGNALS, WARNING_SIGNALS

NONE, STOP, REQUEUE = 0, 1, 2  # flag values, ordered so that MAX picks the strongest request


class PreemptFlag:
    """Signal handlers that only record the strongest request seen; `installed()` scopes them."""

    def __init__(self):
        self.value = NONE
        self.signal_name: Optional[str] = None
        self._previous: dict[int, object] = {}
        self._seen: set[int] = set()

    def _handle(self, signum, _frame) -> None:
        if signum in STOP_SIGNALS and signum in self._seen:
            # A second SIGTERM means "now": die as if no handler were installed (a hung rank stays killable).
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._seen.add(signum)
        want = REQUEUE if signum in WARNING_SIGNALS else STOP
        if want > self.value:
            self.value, self.signal_name = want, signal.Signals(signum).name

    def install(self) -> "PreemptFlag":
        # signal.signal works only in the main thread; elsewhere (a test harness thread) no handlers.
        if threading.current_thread() is threading.main_thread():
            for sig in WARNING_SIGNALS + STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            # A process that blocked these signals from its start (so that one arriving during the
            # slow imports stays pending instead of killing it) gets them delivered here, now handled.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, WARNING_SIGNALS + STOP_SIGNALS)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> "PreemptFlag":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


class StepBoundary:
    """The one per-step collective: (stop request, unfinished async shards) agreed by MAX."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.device = world_size, device

    def agree(self, flag: int, pending: int) -> tuple[int, int]:
        """(max flag, max pending) over all ranks; every rank gets the same pair."""
        if self.world_size == 1:
            return flag, pending
        t = torch.tensor([flag, pending], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t[0].item()), int(t[1].item())
