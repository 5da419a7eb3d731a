"""Naming the rank behind a failed collective: a dead or hung rank must never be a silent hang.

Every collective runs under the process group's timeout (`launcher.timeout_s`, set in
megaft.launch.rank for the local, torchrun and Slurm paths alike), so a survivor waiting
on a hung rank fails after at most that long, and on a dead one as soon as its
connection closes. Neither gloo's nor NCCL's error says which peer is missing, so each
rank whose collective failed leaves a marker file in `<run_dir>/.health/` and waits
briefly (at most min(timeout_s, 30) s) for the others' markers. The ranks that never
report are the suspects: dead, or hung outside any collective. A rank that failed by
itself (any other exception) leaves a marker saying so, which the others quote. Rank 0 holds
the report (below); the other survivors exit only after it has composed it, since under
`srun --kill-on-bad-exit` the first rank out gets the rest killed.

The hang report (issue 17): at start every rank writes `who_<rank>.json` (host, pid,
grid coordinates), and a failed collective's marker also holds what the rank was
waiting for (megaft.launch.trace: the step and the last collectives with sequence
numbers, and the pipeline action it was executing). `hang_report` joins them into lines
a launcher prints: each rank's host, (pp, dp, cp, tp), step, pipeline action and last
collective, and which ranks are behind (no report: they never reached the collective
the others wait in; or an earlier step).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Optional

from megaft.fileio import write_json_atomic

HEALTH_DIR = ".health"
MAX_WAIT_S = 30.0  # a survivor waits at most this long for the others' markers
# Under `srun --kill-on-bad-exit` the first rank to exit gets every other one killed: the other
# survivors hold their exit this long after rank 0 has composed its report, so that it is printed.
REPORT_GRACE_S = 2.0
_COMM_PATTERNS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
                  "NCCL", "Broken pipe", "Socket Timeout",
                  "Application timeout caused pair closure")  # gloo, when the peer's side timed out first


class RankFailureError(RuntimeError):
    """A collective failed because another rank died or hung; the message names it."""


def is_comm_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective's failure (timeout or lost peer) rather than this rank's own bug."""
    import torch.distributed as dist  # here: the launcher that reads the markers imports no torch

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


def announce(run_dir: str, rank: int, coords: dict[str, int]) -> None:
    """At start: this rank's host, pid and grid coordinates, for reports naming it."""
    os.makedirs(os.path.join(run_dir, HEALTH_DIR), exist_ok=True)
    write_json_atomic(os.path.join(run_dir, HEALTH_DIR, f"who_{rank:05d}.json"),
                      {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "coords": coords,
                       "time": time.time()})


def report_crash(exc: BaseException, run_dir: str, rank: int) -> None:
    """This rank failed by itself: tell the others what to quote."""
    os.makedirs(os.path.join(run_dir, HEALTH_DIR), exist_ok=True)
    write_json_atomic(_marker(run_dir, rank), {"rank": rank, "kind": "crash", "time": time.time(),
                                               "error": _first_line(exc)})


def diagnose(exc: BaseException, run_dir: str, rank: int, world: int, timeout_s: float,
             wait_s: Optional[float] = None, waiting: Optional[dict] = None) -> RankFailureError:
    """The error this rank raises after its collective failed with `exc`, naming the suspects.
    `waiting`: what this rank was waiting for (CollectiveTrace.snapshot), kept in its marker."""
    now = time.time()
    os.makedirs(os.path.join(run_dir, HEALTH_DIR), exist_ok=True)
    write_json_atomic(_marker(run_dir, rank), {"rank": rank, "kind": "comm", "time": now,
                                               "error": _first_line(exc), "waiting": waiting})
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
    error = _named(head, crashed, silent, wait, timeout_s)
    report = hang_report(run_dir, world, since) if rank == 0 else None  # under srun: in rank 0's log
    if rank == 0:
        if report and os.environ.get("SLURM_PROCID") is not None:
            # printed now, not only with the exception: tearing the process group down first may take
            # longer than the others' grace, and srun's kill would cut the report
            print(f"{error}\n{report}", file=sys.stderr, flush=True)
        write_json_atomic(_reported(run_dir), {"time": time.time()})
    else:
        _await_report(run_dir, since, wait)
    return RankFailureError(f"{error}\n{report}") if report else RankFailureError(error)


def _reported(run_dir: str) -> str:
    return os.path.join(run_dir, HEALTH_DIR, "reported.json")


def _await_report(run_dir: str, since: float, wait: float) -> None:
    """Hold this rank's exit until rank 0 has composed its report (at most `wait` s, rank 0 may be
    the one behind), then REPORT_GRACE_S more for it to be printed."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(_reported(run_dir)) as f:
                if json.load(f).get("time", 0) >= since:
                    time.sleep(REPORT_GRACE_S)
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)


def _named(head: str, crashed: dict, silent: list, wait: float, timeout_s: float) -> str:
    if crashed:
        who = "; ".join(f"rank {r} failed with {err}" for r, err in sorted(crashed.items()))
        return f"{head}: {who}"
    if silent:
        names = ", ".join(str(r) for r in silent)
        return (f"{head}: suspected rank(s) {names}: they did not report this failure within {wait:g}s, so they "
                f"died or hang outside a collective (launcher.timeout_s={timeout_s}); check their logs")
    return f"{head}: every rank saw the failure, none is singled out (mismatched collectives or a network problem?)"


def _who(run_dir: str, rank: int) -> dict:
    try:
        with open(os.path.join(run_dir, HEALTH_DIR, f"who_{rank:05d}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _place(who: dict) -> str:
    c = who.get("coords") or {}
    grid = " ".join(f"{k}={c[k]}" for k in ("pp", "dp", "cp", "tp") if k in c)
    return f"on {who.get('host', '?')} ({grid or 'coordinates unknown'})"


def hang_report(run_dir: str, world: int, since: float) -> Optional[str]:
    """Lines naming every rank's host, coordinates, step and last collective, and the ranks behind;
    None when no rank reported a failed collective since `since` (not a hang).

    Behind: a rank that never reported; one at an earlier step; and one that entered the
    collective it failed in only after another rank had already given up on it (it was
    stopped or slow, and resumed late: Slurm sends SIGCONT to a frozen task when it ends
    the step, so a SIGSTOPped rank often reports too)."""
    from megaft.launch.trace import describe

    records = {r: _read(run_dir, r, since) for r in range(world)}
    comm = {r: rec for r, rec in records.items() if rec and rec.get("kind") == "comm"}
    if not comm:
        return None
    first_failure = min(rec["time"] for rec in comm.values())
    steps = [w.get("step") for w in ((rec.get("waiting") or {}) for rec in comm.values())]
    top = max((s for s in steps if s is not None), default=None)
    lines, behind = [], []
    for r in range(world):
        rec, where = records[r], _place(_who(run_dir, r))
        if rec is None:
            lines.append(f"  rank {r} {where}: no report (hung outside a collective, or dead)")
            behind.append(r)
        elif rec.get("kind") == "crash":
            lines.append(f"  rank {r} {where}: failed by itself: {rec['error']}")
        else:
            waiting = rec.get("waiting") or {}
            entries = waiting.get("collectives", [])
            last = ([e for e in entries if e["state"] == "waiting"] or entries[-1:])[-1:]
            step = waiting.get("step")
            late = bool(last) and last[0].get("time", 0) > first_failure
            what = describe(last[0]) if last else "no collective recorded"
            action = f", pipeline action {waiting['action']}" if waiting.get("action") else ""
            lines.append(f"  rank {r} {where}: {'starting up' if step is None else f'step {step}'}{action}, in {what}"
                         + (", entered after another rank had failed on it (late)" if late else ""))
            if late or (top is not None and step is not None and step < top):
                behind.append(r)
    head = "megaft: hang report: " + (f"rank(s) {', '.join(map(str, behind))} behind" if behind else
                                      "no rank singled out")
    return "\n".join([head] + lines)

def silent_hosts(run_dir: str, world: int, since: float) -> list[str]:
    """Hosts of the ranks that wrote no marker since `since` (lost with their node, or hung)."""
    return sorted({_who(run_dir, r).get("host", "") for r in range(world) if _read(run_dir, r, since) is None} - {""})
