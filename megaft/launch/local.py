"""The local launcher: start `launcher.nproc` ranks on this machine and watch them.

The parent waits on every child at once. On the first rank that exits non-zero it
stops the others (SIGKILL: they are stuck in, or about to fail, a collective with
the dead rank) and raises RankFailedError naming that rank, its exit code or signal
and the one-line error it reported. SIGUSR1/SIGTERM sent to the parent (e.g. by
Slurm to a batch script that runs megaft-train) are forwarded to every rank, which
then stop together at the next step boundary (megaft.training.stop).

Ctrl-C (SIGINT) is forwarded as SIGTERM: the ranks save at the next step boundary and
the run ends without requeueing. The ranks run in their own process group, so the
terminal's SIGINT reaches only this parent (no rank dies of it, nor gets it twice),
and they die with it (PR_SET_PDEATHSIG) if it is killed. A second SIGINT/SIGTERM to
the parent kills the ranks at once (a rank stuck in a collective cannot save).

The parent holds the run directory's lock (megaft.launch.runlock) while ranks run,
and with `launcher.max_restarts` > 0 starts a failed rank set again, which resumes
from the newest checkpoint; summary.json then records `restarts`.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import time
import traceback
from typing import Callable, Optional

from megaft.config import Config
from megaft.launch import health
from megaft.launch.elastic import record_restarts
from megaft.launch.runlock import run_lock
from megaft.launch.stopped import EXIT_STOPPED, RunStoppedError, stopped_message
from megaft.signals import STOP_SIGNALS, WARNING_SIGNALS

Worker = Callable[[int, Config, str, int, str], None]  # (local_rank, cfg, run_dir, nproc, init_file)


class RankFailedError(RuntimeError):
    """A rank started by the local launcher failed; the message names it."""


class InterruptedRunError(RuntimeError):
    """A second SIGINT/SIGTERM to the launcher killed the ranks without a checkpoint."""


def _detach() -> None:
    """In a rank: leave the terminal's process group (Ctrl-C goes to the parent only) and die
    with the parent, so a SIGKILLed launcher leaves no rank behind (Linux prctl)."""
    os.setpgid(0, 0)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the prctl
        os._exit(1)


def _local_worker(local_rank: int, cfg: Config, run_dir: str, nproc: int, init_file: str) -> None:
    from megaft.launch.rank import local_worker

    local_worker(local_rank, cfg, run_dir, nproc, init_file)


def _child(worker: Worker, rank: int, cfg: Config, run_dir: str, nproc: int, init_file: str, errors) -> None:
    _detach()
    try:
        worker(rank, cfg, run_dir, nproc, init_file)
    except SystemExit as exc:
        if exc.code != EXIT_STOPPED:  # the one deliberate exit: stopped after a checkpoint
            errors.put((rank, f"SystemExit: {exc.code}"))
        raise
    except BaseException as exc:
        lines = traceback.format_exception_only(type(exc), exc)
        errors.put((rank, "".join(lines).strip()[-2000:]))
        raise


def _describe(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _wait_first_failure(procs) -> Optional[int]:
    """Wait until every child exited 0 or EXIT_STOPPED (None), or one exited otherwise (its rank)."""
    alive = dict(enumerate(procs))
    while alive:
        ready = multiprocessing.connection.wait([p.sentinel for p in alive.values()])
        for rank, proc in list(alive.items()):
            if proc.sentinel in ready:
                proc.join()
                del alive[rank]
                if proc.exitcode not in (0, EXIT_STOPPED):
                    return rank
    return None


class _Forwarder:
    """The parent's handlers: warnings go to the ranks as they are, the first SIGINT/SIGTERM as
    SIGTERM (save and stop), a second one kills the ranks."""

    def __init__(self, procs):
        self.procs, self.stops, self.previous = procs, 0, {}

    def _send(self, signum: int) -> None:
        for p in self.procs:
            if p.pid and p.exitcode is None:
                os.kill(p.pid, signum)

    def __call__(self, signum, _frame) -> None:
        if signum in WARNING_SIGNALS:
            self._send(signum)
            return
        self.stops += 1
        self._send(signal.SIGTERM if self.stops == 1 else signal.SIGKILL)

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in WARNING_SIGNALS + STOP_SIGNALS + (signal.SIGINT,):
                self.previous[sig] = signal.signal(sig, self)
            # megaft-train blocks them from its start (megaft/cli.py): one that came during the
            # imports is forwarded now; the ranks keep them blocked until their own handlers exist.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, WARNING_SIGNALS)

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _run_once(cfg: Config, run_dir: str, worker: Worker) -> None:
    """Start the ranks once and wait; raises RankFailedError (or InterruptedRunError)."""
    nproc = cfg.launcher.nproc
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    started = time.time()  # health markers of earlier attempts are older
    with tempfile.TemporaryDirectory(prefix="megaft-rdzv-") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_child, args=(worker, r, cfg, run_dir, nproc, init_file, errors),
                             name=f"megaft-rank-{r}") for r in range(nproc)]
        forwarder = _Forwarder(procs)
        try:
            for p in procs:
                p.start()
            forwarder.install()
            failed = _wait_first_failure(procs)
        finally:
            forwarder.uninstall()
            for p in procs:  # after a failure (or an exception here): nobody is left behind
                if p.pid and p.exitcode is None:
                    p.kill()
                    p.join()
    if forwarder.stops > 1 and any(p.exitcode == -signal.SIGKILL for p in procs):
        raise InterruptedRunError(f"a second stop signal killed the {nproc} rank(s) without a checkpoint; the "
                                  "newest checkpoint in the run directory (if any) is where a rerun resumes")
    if failed is not None:
        reported = {}
        while not errors.empty():
            rank, msg = errors.get()
            reported.setdefault(rank, msg)
        detail = reported.get(failed, "no Python error reported (killed, or it called os._exit)")
        report = health.hang_report(run_dir, nproc, since=started)  # who was behind, when a collective timed out
        extra = f"\n{report}" if report and report not in detail else ""  # rank 0's error may quote it already
        raise RankFailedError(f"rank {failed} of {nproc} {_describe(procs[failed].exitcode)}; the other ranks were "
                              f"stopped. Its error: {detail}{extra}")
    if any(p.exitcode == EXIT_STOPPED for p in procs):  # every rank saved and stopped together
        raise RunStoppedError(stopped_message({"stopped_by": "SIGTERM" if forwarder.stops else "a signal"}))


def launch_local(cfg: Config, run_dir: str, worker: Optional[Worker] = None) -> None:
    """Spawn nproc ranks running `worker` and wait; raises RankFailedError on the first failed rank
    once `launcher.max_restarts` restarts are used up (each restart resumes the newest checkpoint).

    Rendezvous goes through a file in a fresh temporary directory, so concurrent runs
    on one machine never race for a TCP port. `worker` is for tests (fault injection).
    The run directory's lock is held throughout (RunLockedError before any rank starts).
    The default worker is megaft.launch.rank.local_worker, imported in each rank only: this
    process (megaft-train's parent on a CPU run) never imports torch.
    """
    worker = worker or _local_worker
    with run_lock(run_dir):
        restarts = 0
        while True:
            try:
                _run_once(cfg, run_dir, worker)
                break
            except RankFailedError as exc:
                if restarts >= cfg.launcher.max_restarts:
                    raise
                restarts += 1
                print(f"megaft: {exc}\nmegaft: restarting the {cfg.launcher.nproc} rank(s), restart {restarts} of "
                      f"at most {cfg.launcher.max_restarts} (launcher.max_restarts); they resume from the newest "
                      "checkpoint", flush=True)
        record_restarts(run_dir, restarts)
