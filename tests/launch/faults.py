"""Fault-injecting workers for the local launcher (tests/launch/test_faults.py).

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


def _inject(action) -> None:
    original = loop.Trainer.train_step

    def train_step(self, step):
        if self.grid.rank == 1 and step == FAULT_STEP:
            action(self)
        return original(self, step)

    loop.Trainer.train_step = train_step


def signal_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 gets SIGUSR1 in the middle of step FAULT_STEP (as `scancel --signal=USR1` would)."""
    _inject(lambda trainer: os.kill(os.getpid(), signal.SIGUSR1))
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def _hang(trainer):
    with open(os.path.join(trainer.run_dir, HANG_MARK), "w") as f:
        f.write(repr(time.time()))
    time.sleep(3600)


def hang_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 stops making progress (outside any collective) at step FAULT_STEP."""
    _inject(_hang)
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def _die(trainer):
    with open(os.path.join(trainer.run_dir, HANG_MARK), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def die_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 is killed (SIGKILL, as the OOM killer would) at step FAULT_STEP."""
    _inject(_die)
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def die_once_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Like die_worker, but only in the first attempt (HANG_MARK not yet written): a restart runs clean."""
    if not os.path.exists(os.path.join(run_dir, HANG_MARK)):
        _inject(_die)
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


SLOW_S = 1.0  # seconds rank 1 sleeps in every step under slow_worker


def slow_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 is a straggler: SLOW_S more work in every step (before its first collective)."""
    original = loop.Trainer.train_step

    def train_step(self, step):
        if self.grid.rank == 1:
            time.sleep(SLOW_S)
        return original(self, step)

    loop.Trainer.train_step = train_step
    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def _stop(trainer):
    with open(os.path.join(trainer.run_dir, HANG_MARK), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def sigstop_worker(local_rank, cfg, run_dir, nproc, init_file):
    """Rank 1 is frozen by SIGSTOP at the start of step FAULT_STEP (a rank that stops responding)."""
    _inject(_stop)
    local_worker(local_rank, cfg, run_dir, nproc, init_file)
