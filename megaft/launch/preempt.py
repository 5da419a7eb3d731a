"""Preemption and time limits: a signal sets a flag, ranks agree at step boundaries, rank 0 requeues.

Slurm warns a job before its time limit with `#SBATCH --signal=USR1@<seconds>` (or a
user sends `scancel --signal=USR1 <job>`), and preemption/scancel send SIGTERM. The
handlers only set a flag: nothing is safe to do inside a signal handler while a
collective may be in flight. At every step boundary `StepBoundary.agree` combines
this rank's flag (and the async-save progress, megaft.checkpoint.async_save) with
ONE all_reduce(MAX) over the world, so every rank stops after the same step; it
works on gloo and NCCL alike. The trainer then saves and returns; rank 0 calls
`requeue()`.

- SIGUSR1 (time limit / an explicit request): save, requeue, exit 0. SIGUSR2, the
  signal submitit asks Slurm for before a time limit, does the same: during training
  it takes over submitit's own handler, so submitit jobs requeue exactly like sbatch ones.
- SIGTERM (scancel, or Slurm's own preemption, which requeues by itself): save and
  exit 0 without requeueing, so `scancel` still ends a job for good. A second
  SIGTERM kills the process at once (a rank stuck in a collective stays killable).

Requeueing is `scontrol requeue $SLURM_JOB_ID`, the route submitit's own checkpoint
handler takes too, so it also works for submitit-launched jobs. `launcher.max_requeue`
bounds it: SLURM_RESTART_COUNT (how often Slurm restarted this job) at or past it
means the job saves and ends with a message instead of requeueing forever.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from megaft.launch.entry import WARNING_SIGNALS

log = logging.getLogger("megaft")

# Stop, save and requeue: USR1 from `--signal=USR1@N`/scancel, USR2 from submitit's `--signal=USR2@N`
# (the signals megaft-train blocks before its imports: one definition, in the light entry module).
REQUEUE_SIGNALS = WARNING_SIGNALS
STOP_SIGNALS = (signal.SIGTERM,)  # stop and save; Slurm decides the job's fate
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
        want = REQUEUE if signum in REQUEUE_SIGNALS else STOP
        if want > self.value:
            self.value, self.signal_name = want, signal.Signals(signum).name

    def install(self) -> "PreemptFlag":
        # signal.signal works only in the main thread; elsewhere (a test harness thread) no handlers.
        if threading.current_thread() is threading.main_thread():
            for sig in REQUEUE_SIGNALS + STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            # A process that blocked these signals from its start (so that one arriving during the
            # slow imports stays pending instead of killing it) gets them delivered here, now handled.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, REQUEUE_SIGNALS + STOP_SIGNALS)
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


def restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    env = os.environ if environ is None else environ
    value = env.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def requeue(max_requeue: int, environ: Optional[Mapping[str, str]] = None,
            run=subprocess.run) -> str:
    """Requeue this Slurm job unless max_requeue is reached; returns the message it logged.

    Call on one rank only, after every rank's checkpoint is published. Not under a
    Slurm job (no SLURM_JOB_ID) there is nothing to requeue: the message says how to
    resume by hand.
    """
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")  # an array task has its own SLURM_JOB_ID too
    if not job:
        msg = "megaft: stopped by a signal and saved a checkpoint; not a Slurm job, so not requeued: " \
              "run the same command again to resume"
    elif restart_count(env) >= max_requeue:
        msg = (f"megaft: stopped by a signal and saved a checkpoint; job {job} was already requeued "
               f"{restart_count(env)} time(s) (launcher.max_requeue={max_requeue}), so it is NOT requeued "
               "again: resubmit it to resume, or raise launcher.max_requeue")
    else:
        out = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            msg = (f"megaft: stopped by a signal and saved a checkpoint; requeued Slurm job {job} "
                   f"(restart {restart_count(env) + 1} of at most {max_requeue}); it resumes from the checkpoint")
        else:
            msg = (f"megaft: stopped by a signal and saved a checkpoint; `scontrol requeue {job}` failed "
                   f"({out.returncode}: {(out.stderr or out.stdout).strip()}): resubmit the job to resume")
    log.warning(msg)
    print(msg, flush=True)
    return msg
