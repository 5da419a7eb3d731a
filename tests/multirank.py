"""spawn(): run a function on N CPU ranks with gloo and re-raise any rank's failure.

The ranks are a persistent pool of processes per world size, started on the first
spawn() of that size with torch and megaft's training stack already imported: starting
fresh processes cost ~1.2 s per call plus ~1.5 s of imports per rank, for each of the
~40 calls of the suite. Every call still gets what a fresh process would give it:

- its own file:// rendezvous under a new temporary directory (no port races) and a new
  gloo process group (none with group=False), destroyed when it ends;
- the caller's os.environ (tests monkeypatch it before spawning), cwd and sys.path
  (pytest inserts test folders; fn and args are pickled by module name), restored after;
- one torch thread (CI has 2 cores), a fresh RNG seed, torch's default dtype and grad
  mode, the signal handlers and mask the worker started with, faulthandler on (a native
  abort prints every thread's Python stack).

A rank's exception comes back as its traceback ("multi-rank test failed:\n--- rank N ---\n
<traceback>"). A call that outlives `timeout` (a hang outside a collective: the process
group's TIMEOUT catches those inside one) gets SIGABRT, so faulthandler prints where each
rank is, and fails; a failure that leaves ranks behind, a dead worker (os._exit, a
segfault) or a timeout tears the pool down and the next call starts a new one. The pools
stop at exit (tests/conftest.py calls shutdown() at the end of the session).
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)  # a collective that waits longer than this fails the rank
CALL_TIMEOUT_S = 900.0  # a whole spawn() call; the slowest takes ~40 s on an idle 2-core machine
GRACE_S = 2.0  # after one rank failed: how long the others get to report before they are killed
# A worker past either limit after a call is replaced (with its whole pool) before the next one. Trainers
# are not freed: megaft's DP grad hooks (register_post_accumulate_grad_hook, held from C++ where gc cannot
# see the cycle) keep every run's model, optimizer and gloo groups alive, ~5 fds and a thread per run.
MAX_RSS_MB, MAX_THREADS = 1536, 400
_DIED = object()
_SIGNALS = [s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)]


def _run(rank: int, world: int, init_file: str, fn, args, group: bool) -> None:
    if not group:  # fn makes its own process groups (megaft.launch.rank.run_rank per run)
        fn(rank, world, *args)
        return
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears its group down while a peer may still have traffic in flight
    finally:
        dist.destroy_process_group()


# ---- the pooled worker ----

def _preload() -> None:
    """What nearly every rank function imports, once per worker instead of once per call."""
    import torch.utils.tensorboard  # noqa: F401  (metrics' event files: 0.3 s)

    import megaft.launch.rank  # noqa: F401  (group=False runs: run_rank)
    import megaft.training.loop  # noqa: F401  (the Trainer and its parts)


class _Clean:
    """The state a fresh worker starts with, put back after every call."""

    def __init__(self):
        self.env, self.cwd, self.path = dict(os.environ), os.getcwd(), list(sys.path)
        self.handlers = {s: signal.getsignal(s) for s in _SIGNALS}
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    def restore(self) -> None:
        if dist.is_initialized():  # a group=False function left its group up
            dist.destroy_process_group()
        _set_env(self.env)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for sig, handler in self.handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)


def _set_env(env: dict) -> None:
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _serve(rank: int, world: int, conn) -> None:
    """A pooled rank: run calls as they come until told to stop (None) or the parent goes away."""
    faulthandler.enable()
    torch.set_num_threads(1)
    _preload()
    clean = _Clean()
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):  # the parent died
            break
        if call is None:
            break
        env, cwd, path, init_file, group, payload = call
        result = None
        try:
            _set_env(env)
            os.chdir(cwd)
            sys.path[:] = path
            torch.seed()  # a fresh process starts from a random seed too: nothing may depend on the last call's
            fn, args = pickle.loads(payload)
            _run(rank, world, init_file, fn, args, group)
        except BaseException:
            result = traceback.format_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            clean.restore()
        except BaseException:  # report it, and end this worker: the next call starts a new pool
            conn.send(((result or "") + "\nrestoring the pooled worker failed:\n" + traceback.format_exc(), True))
            break
        conn.send((result, _worn()))
    sys.stdout.flush()
    sys.stderr.flush()
    # A rank once died of SIGABRT in CI with no Python error (tests/models/test_arch.py, pp=2). If
    # that was interpreter finalization (C++ static destructors racing gloo's threads), exiting
    # here skips it; if not, faulthandler above prints where it was.
    os._exit(0)


def _worn() -> bool:
    """Whether this process grew past MAX_RSS_MB or MAX_THREADS (Linux; elsewhere never)."""
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f)
        return int(status["VmRSS"].split()[0]) > MAX_RSS_MB * 1024 or int(status["Threads"]) > MAX_THREADS
    except (OSError, KeyError, ValueError):
        return False


class _Pool:
    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world, self.procs, self.conns = world, [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, child), name=f"multirank-{world}-{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def call(self, fn, args, group: bool, timeout: float) -> None:
        payload = pickle.dumps((fn, args))  # here, so an unpicklable fn fails in the test, not in a rank
        with tempfile.TemporaryDirectory() as tmp:
            call = (dict(os.environ), os.getcwd(), list(sys.path), os.path.join(tmp, "rendezvous"), group, payload)
            for conn in self.conns:
                try:
                    conn.send(call)
                except OSError:
                    pass  # a dead worker: _collect reports it
            errors = self._collect(timeout)
        if errors:
            raise AssertionError("multi-rank test failed:\n" + "\n".join(
                f"--- rank {rank} ---\n{errors[rank]}" for rank in sorted(errors)))

    def _collect(self, timeout: float) -> dict[int, str]:
        """Wait for every rank's result: {rank: traceback, or what happened to it} for those that failed.
        Closes the pool when a worker died, had to be killed or grew past the limits."""
        waiting, errors, worn = set(range(self.world)), {}, False
        deadline = time.monotonic() + timeout
        while waiting:
            handles = {self.conns[r]: r for r in waiting} | {self.procs[r].sentinel: r for r in waiting}
            ready = multiprocessing.connection.wait(list(handles), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                self._abort(waiting, errors, timeout)
                return errors
            for rank in sorted({handles[h] for h in ready}):
                try:
                    result, tired = self.conns[rank].recv() if self.conns[rank].poll() else (_DIED, True)
                except (EOFError, OSError):
                    result, tired = _DIED, True
                worn |= tired
                if result is _DIED:
                    self.procs[rank].join(5)
                    result = f"its process died ({_exit_status(self.procs[rank].exitcode)}) without a result"
                waiting.discard(rank)
                if result is not None:
                    errors[rank] = result
            if errors and waiting:  # the others most likely wait on the failed rank: a short grace
                deadline = min(deadline, time.monotonic() + GRACE_S)
        if worn or not self.alive():
            self.close()
        return errors

    def _abort(self, waiting: set, errors: dict, timeout: float) -> None:
        """Kill the pool; the ranks still running get a line in `errors`."""
        if errors:
            why = f"still running {GRACE_S:.0f} s after rank(s) {sorted(errors)} failed: killed"
        else:  # a hang: faulthandler prints each rank's Python stacks on SIGABRT
            why = f"did not finish within {timeout:.0f} s: its stacks (faulthandler) are in the captured stderr"
            for rank in waiting:
                _kill(self.procs[rank], signal.SIGABRT)
            for rank in waiting:
                self.procs[rank].join(5)
        for rank in waiting:
            errors[rank] = why
        self.close()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        """Stop the workers: politely when idle, SIGKILL after 5 s."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if _POOLS.get(self.world) is self:
            del _POOLS[self.world]


def _kill(proc, sig) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def _exit_status(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


_POOLS: dict[int, _Pool] = {}


def shutdown() -> None:
    """Stop every pool (idempotent)."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(shutdown)


def spawn(world: int, fn, *args, group: bool = True, timeout: float = CALL_TIMEOUT_S) -> None:
    """Run fn(rank, world, *args) on `world` gloo ranks; fn must be importable (top level).
    group=False: no process group around fn (it starts its own, e.g. one per training run)."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[world] = _Pool(world)
    pool.call(fn, args, group, timeout)
