"""Fault-injecting workers for the local launcher (test_faults, test_elastic, test_hang_report).

Each wraps megaft.launch.rank.local_worker and patches Trainer.train_step in the child
process only, so rank 1 signals itself, hangs or dies at a chosen step.
"""
from __future__ import annotations

import os
import signal
import time

from megaft.launch.rank import local_worker
from megaft.training import loop

FAULT_STEP = 3  # 0-based step during which rank 1 misbehaves
HANG_MARK = "hang_started"  # in the run dir: when rank 1 stopped making progress


def _inject(action, at_step=FAULT_STEP) -> None:
    """Rank 1 runs action(trainer) at the start of step `at_step` (of every step if None)."""
    original = loop.Trainer.train_step

    def train_step(self, step):
        if self.grid.rank == 1 and (at_step is None or step == at_step):
            action(self)
        return original(self, step)

    loop.Trainer.train_step = train_step


def _mark_fault(trainer) -> None:
    """Write HANG_MARK: the time rank 1 stopped making progress."""
    with open(os.path.join(trainer.run_dir, HANG_MARK), "w") as f:
        f.write(repr(time.time()))


def _mark_and_signal(sig):
    """The action: write HANG_MARK, then send `sig` to this rank's own process."""
    def action(trainer):
        _mark_fault(trainer)
        os.kill(os.getpid(), sig)
    return action


def signal_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 gets SIGUSR1 in the middle of step FAULT_STEP (as `scancel --signal=USR1` would)."""
    _inject(lambda trainer: os.kill(os.getpid(), signal.SIGUSR1))
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def _hang(trainer):
    _mark_fault(trainer)
    time.sleep(3600)


def hang_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 stops making progress (outside any collective) at step FAULT_STEP."""
    _inject(_hang)
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def die_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 is killed (SIGKILL, as the OOM killer would) at step FAULT_STEP."""
    _inject(_mark_and_signal(signal.SIGKILL))
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def die_once_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Like die_worker, but only in the first attempt (HANG_MARK not yet written): a restart runs clean."""
    if not os.path.exists(os.path.join(run_dir, HANG_MARK)):
        _inject(_mark_and_signal(signal.SIGKILL))
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


SLOW_S = 1.0  # seconds rank 1 sleeps in every step under slow_worker


def slow_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 is a straggler: SLOW_S more work in every step (before its first collective)."""
    _inject(lambda trainer: time.sleep(SLOW_S), at_step=None)
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def sigstop_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 is frozen by SIGSTOP at the start of step FAULT_STEP (a rank that stops responding)."""
    _inject(_mark_and_signal(signal.SIGSTOP))
    local_worker(local_rank, cfg, run_dir, nproc, init_file)
