"""The local launcher: start `launcher.nproc` ranks on this machine and watch them.

The parent waits on every child at once. On the first rank that exits non-zero it
stops the others (SIGKILL: they are stuck in, or about to fail, a collective with
the dead rank) and raises RankFailedError naming that rank, its exit code or signal
and the one-line error it reported. SIGUSR1/SIGTERM sent to the parent (e.g. by
Slurm to a batch script that runs megaft-train) are forwarded to every rank, which
then stop together at the next step boundary (megaft.launch.preempt).
"""
from __future__ import annotations

import multiprocessing.connection
import os
import signal
import tempfile
import threading
import traceback
from typing import Callable, Optional

import torch.multiprocessing as mp

from megaft.config import Config
from megaft.launch.preempt import REQUEUE_SIGNALS, STOP_SIGNALS
from megaft.launch.rank import local_worker

Worker = Callable[[int, Config, str, int, str], None]  # (local_rank, cfg, run_dir, nproc, init_file)


class RankFailedError(RuntimeError):
    """A rank started by the local launcher failed; the message names it."""


def _child(worker: Worker, rank: int, cfg: Config, run_dir: str, nproc: int, init_file: str, errors) -> None:
    try:
        worker(rank, cfg, run_dir, nproc, init_file)
    except BaseException as exc:
        lines = traceback.format_exception_only(type(exc), exc)
        errors.put((rank, "".join(lines).strip()[-2000:]))
        raise


def _describe(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _wait_first_failure(procs) -> Optional[int]:
    """Wait until every child exited 0 (None) or one exited non-zero (its rank)."""
    alive = dict(enumerate(procs))
    while alive:
        ready = multiprocessing.connection.wait([p.sentinel for p in alive.values()])
        for rank, proc in list(alive.items()):
            if proc.sentinel in ready:
                proc.join()
                del alive[rank]
                if proc.exitcode != 0:
                    return rank
    return None


def launch_local(cfg: Config, run_dir: str, worker: Worker = local_worker) -> None:
    """Spawn nproc ranks running `worker` and wait; raises RankFailedError on the first failed rank.

    Rendezvous goes through a file in a fresh temporary directory, so concurrent runs
    on one machine never race for a TCP port. `worker` is for tests (fault injection).
    """
    nproc = cfg.launcher.nproc
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    previous = {}
    with tempfile.TemporaryDirectory(prefix="megaft-rdzv-") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_child, args=(worker, r, cfg, run_dir, nproc, init_file, errors),
                             name=f"megaft-rank-{r}") for r in range(nproc)]

        def forward(signum, _frame):
            for p in procs:
                if p.pid and p.exitcode is None:
                    os.kill(p.pid, signum)

        try:
            for p in procs:
                p.start()
            if threading.current_thread() is threading.main_thread():
                for sig in REQUEUE_SIGNALS + STOP_SIGNALS:
                    previous[sig] = signal.signal(sig, forward)
                # megaft-train blocks them from its start (launch/entry.py): one that came during the
                # imports is forwarded now; the ranks keep them blocked until their own handlers exist.
                signal.pthread_sigmask(signal.SIG_UNBLOCK, REQUEUE_SIGNALS)
            failed = _wait_first_failure(procs)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for p in procs:  # after a failure (or an exception here): nobody is left behind
                if p.pid and p.exitcode is None:
                    p.kill()
                    p.join()
    if failed is not None:
        reported = {}
        while not errors.empty():
            rank, msg = errors.get()
            reported.setdefault(rank, msg)
        detail = reported.get(failed, "no Python error reported (killed, or it called os._exit)")
        raise RankFailedError(f"rank {failed} of {nproc} {_describe(procs[failed].exitcode)}; the other ranks were "
                              f"stopped. Its error: {detail}")
