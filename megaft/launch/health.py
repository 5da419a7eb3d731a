"""Naming the rank behind a failed collective: a dead or hung rank must never be a silent hang.

Every collective runs under the process group's timeout (`launcher.timeout_s`, set in
megaft.launch.rank for the local, torchrun and Slurm paths alike), so a survivor waiting
on a hung rank fails after at most that long, and on a dead one as soon as its
connection closes. Neither gloo's nor NCCL's error says which peer is missing, so each
rank whose collective failed leaves a marker file in `<run_dir>/.health/` and waits
briefly (at most min(timeout_s, 30) s) for the others' markers. The ranks that never
report are the suspects: dead, or hung outside any collective. A rank that failed by
itself (any other exception) leaves a marker saying so, which the others quote.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch.distributed as dist

from megaft.fileio import write_json_atomic

HEALTH_DIR = ".health"
MAX_WAIT_S = 30.0  # a survivor waits at most this long for the others' markers
_COMM_PATTERNS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
                  "NCCL", "Broken pipe", "Socket Timeout")


class RankFailureError(RuntimeError):
    """A collective failed because another rank died or hung; the message names it."""


def is_comm_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective's failure (timeout or lost peer) rather than this rank's own bug."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc) for p in _COMM_PATTERNS)


def _marker(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, HEALTH_DIR, f"rank_{rank:05d}.json")


def _read(run_dir: str, rank: int, since: float) -> Optional[dict]:
    try:
        with open(_marker(run_dir, rank)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if record.get("time", 0) >= since else None  # older ones are from an earlier job


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def report_crash(exc: BaseException, run_dir: str, rank: int) -> None:
    """This rank failed by itself: tell the others what to quote."""
    os.makedirs(os.path.join(run_dir, HEALTH_DIR), exist_ok=True)
    write_json_atomic(_marker(run_dir, rank), {"rank": rank, "kind": "crash", "time": time.time(),
                                               "error": _first_line(exc)})


def diagnose(exc: BaseException, run_dir: str, rank: int, world: int, timeout_s: float,
             wait_s: Optional[float] = None) -> RankFailureError:
    """The error this rank raises after its collective failed with `exc`, naming the suspects."""
    now = time.time()
    os.makedirs(os.path.join(run_dir, HEALTH_DIR), exist_ok=True)
    write_json_atomic(_marker(run_dir, rank), {"rank": rank, "kind": "comm", "time": now,
                                               "error": _first_line(exc)})
    wait = min(float(timeout_s), MAX_WAIT_S) if wait_s is None else wait_s
    # Survivors fail up to timeout_s apart (a rank may wait on another survivor first).
    since = now - float(timeout_s) - wait
    deadline = time.monotonic() + wait
    while True:
        records = {r: _read(run_dir, r, since) for r in range(world)}
        silent = [r for r, rec in records.items() if rec is None]
        crashed = {r: rec["error"] for r, rec in records.items() if rec and rec.get("kind") == "crash"}
        if not silent or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    head = f"rank {rank} of {world}: a collective failed ({_first_line(exc)})"
    if crashed:
        who = "; ".join(f"rank {r} failed with {err}" for r, err in sorted(crashed.items()))
        return RankFailureError(f"{head}: {who}")
    if silent:
        names = ", ".join(str(r) for r in silent)
        return RankFailureError(
            f"{head}: suspected rank(s) {names}: they did not report this failure within {wait:g}s, so they died "
            f"or hang outside a collective (launcher.timeout_s={timeout_s}); check their logs")
    return RankFailureError(f"{head}: every rank saw the failure, none is singled out (mismatched collectives "
                            "or a network problem?)")
