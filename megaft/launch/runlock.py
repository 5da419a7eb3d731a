"""One run per run directory: `RUN_DIR/.megaft.lock` names the run that owns it.

Two runs started into one directory would append to the same metrics.jsonl and mix
their checkpoints, so the launcher takes the lock before any rank starts (the local
launcher in its parent process, a Slurm/torchrun world on rank 0) and drops it when
the run ends. The lock is a JSON file created with O_EXCL holding the holder's host,
pid, the pid's start time (so a recycled pid is not mistaken for the holder) and its
Slurm job id. An existing lock is taken over, with a warning, when
- its holder is a process of this host that no longer exists (a crash or SIGKILL left
  it behind: stale), or
- it was taken by this same Slurm job (a requeued job comes back with its own id,
  perhaps on another node, and its earlier attempt is gone).
Otherwise the run fails at once with RunLockedError naming the holder. A lock held on
another host cannot be checked from here: it counts as live, and the message says how
to remove it by hand when that run is known to be gone.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import warnings
from typing import Iterator, Mapping, Optional

LOCK_FILE = ".megaft.lock"
log = logging.getLogger("megaft")


class RunLockedError(RuntimeError):
    """Another live run holds the run directory."""


class StaleLockWarning(UserWarning):
    """A lock left behind by a dead process (or this job's earlier attempt) was taken over."""


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name; 22nd overall


def _alive(pid: int, start: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    now = _start_time(pid)
    return start is None or now is None or now == start  # a recycled pid has another start time


def _me(environ: Mapping[str, str]) -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid),
            "slurm_job_id": environ.get("SLURM_JOB_ID"), "time": time.time()}


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {since}"


def _takeover_reason(holder: dict, me: dict) -> Optional[str]:
    """Why this process may take over `holder`'s lock, or None when the holder may be alive."""
    if holder.get("host") == me["host"] and holder.get("pid") == me["pid"] and holder.get("start") == me["start"]:
        return "held by this process"
    if me["slurm_job_id"] and holder.get("slurm_job_id") == me["slurm_job_id"]:
        return "taken by an earlier attempt of this Slurm job (requeued)"
    if holder.get("host") == me["host"] and not _alive(int(holder.get("pid", -1)), holder.get("start")):
        return "its process no longer exists (stale)"
    return None


def acquire(run_dir: str, environ: Optional[Mapping[str, str]] = None) -> dict:
    """Take the lock of `run_dir` or raise RunLockedError; returns what was written."""
    env = os.environ if environ is None else environ
    path = os.path.join(run_dir, LOCK_FILE)
    me = _me(env)
    os.makedirs(run_dir, exist_ok=True)
    for _ in range(3):  # a concurrent takeover may remove the file between our attempts
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    holder = json.load(f)
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError):
                holder = {}  # half-written by a process that died while writing it
            why = _takeover_reason(holder, me) if holder else "unreadable lock file"
            if why is None:
                raise RunLockedError(
                    f"run directory {run_dir} is in use by another run ({describe(holder)}): two runs in one "
                    "directory would mix their metrics and checkpoints; fix: wait for it to end, use another "
                    f"hydra.run.dir, or, if that run is gone (e.g. its node died), delete {path}")
            if why != "held by this process":
                msg = f"taking over the lock of {run_dir} ({describe(holder)}): {why}"
                warnings.warn(msg, StaleLockWarning, stacklevel=2)
                log.warning(msg)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return me
    raise RunLockedError(f"could not take the lock {path}: other processes keep taking it; fix: one run per "
                         "run directory")


def release(run_dir: str, mine: dict) -> None:
    """Remove the lock if it is still ours (a takeover may have replaced it)."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return
    if holder.get("pid") == mine["pid"] and holder.get("host") == mine["host"]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def run_lock(run_dir: str, *, enabled: bool = True) -> Iterator[Optional[dict]]:
    """Hold the lock of `run_dir` for the body (nothing when not `enabled`, e.g. ranks other than 0)."""
    if not enabled:
        yield None
        return
    mine = acquire(run_dir)
    try:
        yield mine
    finally:
        release(run_dir, mine)
