"""fork_map: a function over chunks of work in forked worker processes, the results in order.

For short CPU-bound commands that run on a login node's cores (megaft-plan's search checks
and costs thousands of layouts, each on its own). A forked child starts with the parent's
imports and data, so only the results cross back, pickled through one pipe per child, and
the parent computes the first chunk meanwhile. The function must be pure: a child's side
effects (caches, prints) stay in the child. Where fork does not exist it runs in order here.
"""
from __future__ import annotations

import os
import pickle
import signal
import traceback
from typing import Callable, Sequence


def usable_cpus() -> int:
    """The CPUs this process may run on (a Slurm allocation's or taskset's, not the node's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def fork_map(fn: Callable, chunks: Sequence) -> list:
    """[fn(chunk) for chunk in chunks]: the first chunk here, each other one in a child of its own.

    A child's exception is raised here as a RuntimeError carrying its traceback; a child that
    dies (killed, out of memory) is an error too. The children are reaped whatever happens."""
    if len(chunks) <= 1 or not hasattr(os, "fork"):
        return [fn(c) for c in chunks]
    children: dict[int, int] = {}  # pid -> read end of its pipe, until reaped
    try:
        for chunk in chunks[1:]:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                _child(fn, chunk, read, write)  # never returns
            os.close(write)
            children[pid] = read
        out = [fn(chunks[0])]
        for pid in list(children):
            with os.fdopen(children[pid], "rb") as pipe:
                payload = pipe.read()
            _, status = os.waitpid(pid, 0)
            del children[pid]
            if not payload:
                raise RuntimeError(f"a worker process (pid {pid}) died before it answered "
                                   f"(wait status {status}); rerun, or with fewer workers")
            ok, value = pickle.loads(payload)
            if not ok:
                raise RuntimeError(f"a worker process failed:\n{value}")
            out.append(value)
        return out
    finally:
        for pid, read in children.items():  # after an error: no child outlives the call
            for undo in (lambda: os.close(read), lambda: os.kill(pid, signal.SIGKILL), lambda: os.waitpid(pid, 0)):
                try:
                    undo()
                except OSError:  # closed already, or the child is gone
                    pass


def _child(fn: Callable, chunk, read: int, write: int) -> None:
    os.close(read)
    try:
        try:
            payload = pickle.dumps((True, fn(chunk)), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - the parent raises it, with this traceback
            payload = pickle.dumps((False, traceback.format_exc()))
        with os.fdopen(write, "wb") as pipe:
            pipe.write(payload)
    finally:
        os._exit(0)  # no atexit handlers, no flush of the parent's buffered output


def deal(items: Sequence, parts: int) -> list[list]:
    """`items` dealt round-robin into at most `parts` hands (neighbours often cost alike, so
    each hand gets a fair share of the dear ones); `undeal` puts the answers back in order."""
    parts = max(1, min(parts, len(items)))
    return [list(items[p::parts]) for p in range(parts)]


def undeal(hands: Sequence[Sequence]) -> list:
    """The inverse of `deal` over per-item answers: undeal(deal(x, n)) == list(x)."""
    out: list = [None] * sum(map(len, hands))
    for p, hand in enumerate(hands):
        out[p::len(hands)] = hand
    return out
