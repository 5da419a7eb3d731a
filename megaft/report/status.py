"""A run's status: what Slurm's queue says (squeue), why a submitted job failed
(submitit's result pickle or the job's stderr), and the status a report row shows."""
from __future__ import annotations

import os
import pickle
import subprocess
from typing import Any, Optional

from megaft.training.summary import RunSummary


def squeue_states() -> Optional[dict[str, str]]:
    """{job id as submitit names it ("123" or "123_4"): state} of queued jobs, None without Slurm."""
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return dict(line.split("|", 1) for line in out.stdout.split() if "|" in line)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (strings, numbers, tuples, lists, dicts): every global, and
    so every callable a crafted pickle could run, is refused. submitit stores a failed job's
    outcome as ("error", traceback string), which needs none."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused {module}.{name}: megaft-report reads plain data only")


def failure_reason(entry: dict[str, Any]) -> str:
    """The last line of the job's error: submitit's result pickle (read as plain data: a
    result file never runs code), else its stderr log."""
    folder, job = entry.get("submitit_folder"), entry.get("job_id")
    if not folder or not job:
        return ""
    try:
        with open(os.path.join(folder, f"{job}_0_result.pkl"), "rb") as f:  # submitit: {job}_{task}_result.pkl
            outcome, value = _PlainUnpickler(f).load()
        if outcome == "error":
            return _last_line(str(value))
    except (OSError, pickle.UnpicklingError, ValueError, EOFError, ImportError, AttributeError):
        pass
    try:
        with open(os.path.join(folder, f"{job}_0_log.err")) as f:
            return _last_line(f.read())
    except OSError:
        return "no result and no log: the job died before it started (see sbatch/Slurm logs)"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_status(entry: dict[str, Any], summary: Optional[RunSummary], has_metrics: bool,
               states: Optional[dict[str, str]]) -> str:
    """invalid | pending | running | done | failed (megaft.report's docstring)."""
    if entry.get("status") == "invalid":
        return "invalid"
    state = (states or {}).get(entry.get("job_id", ""))
    if state:  # a queued job wins over an old summary (a requeued job runs again)
        return "pending" if state in ("PENDING", "REQUEUED", "CONFIGURING") else "running"
    if summary is not None:
        return "done"
    if entry.get("job_id") and states is not None:
        return "failed"  # submitted, gone from the queue, no summary
    return "running" if has_metrics else "pending"
