"""One Hydra multirun of `megaft-train` over named points, through megaft's Slurm launcher.

Hydra's basic sweeper crosses the values of each key, but a plan's layouts (or a scaling
study's node counts) change several keys together. So every point becomes one option of
a generated config group, `<conf_root>/<group>/<name>.yaml` (`# @package _global_`, the
point's overrides as YAML), the folder goes on Hydra's search path, and the multirun
sweeps that group:

    megaft-train -m hydra/launcher=slurm_cpu hydra.searchpath=['file://<conf_root>'] \\
        +plan_probe=rank1,rank2,rank3 hydra.sweep.dir=<sweep_dir> hydra.launcher.wait=true <common overrides>

megaft's launcher validates every point before anything is queued and puts points of one
resource shape into one job array; each point's .hydra/overrides.yaml names its option
(`+plan_probe=rank2`), and submitted.json maps it to its job and run dir. Command-line
overrides win over the group's files, so callers leave the points' keys out of `common`.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

from omegaconf import OmegaConf

from megaft.fileio import read_jsonl
from megaft.launch.submit_record import read_submitted
from megaft.training.phases import PHASE_KEYS
from megaft.training.summary import RunSummary

LOG_FILE = "multirun.log"  # megaft-train -m's stdout and stderr, in the sweep dir


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def point_yaml(overrides: list[str]) -> str:
    """`key=value` overrides as a global-package YAML file (values parsed as Hydra does)."""
    body = OmegaConf.to_yaml(OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
    return "# @package _global_\n" + body


def write_group(conf_root: str, group: str, points: dict[str, list[str]]) -> None:
    folder = os.path.join(conf_root, group)
    os.makedirs(folder, exist_ok=True)
    for name, overrides in points.items():
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(point_yaml(overrides))


def train_command() -> list[str]:
    """megaft-train of this interpreter's environment."""
    return [sys.executable, "-m", "megaft.train"]


def multirun_command(*, group: str, names: list[str], conf_root: str, sweep_dir: str, launcher: list[str],
                     common: list[str]) -> list[str]:
    """The megaft-train -m command line; `launcher`: hydra/launcher=... and hydra.launcher.* overrides
    (default preset: slurm; hydra.launcher.wait is always true: the caller reads the results)."""
    launcher = [o for o in launcher if not o.startswith("hydra.launcher.wait=")]
    if not any(o.startswith("hydra/launcher=") for o in launcher):
        launcher = ["hydra/launcher=slurm", *launcher]
    return [*train_command(), "-m", *launcher, "hydra.launcher.wait=true", f"hydra.sweep.dir={sweep_dir}",
            f"hydra.searchpath=['file://{os.path.abspath(conf_root)}']", f"+{group}={','.join(names)}", *common]


def run_multirun(cmd: list[str], sweep_dir: str, timeout_s: Optional[float]) -> tuple[int, str]:
    """Run `cmd`, its output in sweep_dir/multirun.log; (exit status, the log's tail). On timeout the
    arrays it submitted are cancelled (scancel) and the status is -1."""
    os.makedirs(sweep_dir, exist_ok=True)
    log_path = os.path.join(sweep_dir, LOG_FILE)
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            arrays = [a["array_job_id"] for a in read_submitted(sweep_dir)["arrays"]]
            if arrays:
                subprocess.run(["scancel", *arrays], check=False, capture_output=True)
            status = -1
    with open(log_path) as f:
        tail = "".join(line for line in f.readlines()[-30:] if "sacct" not in line)
    return status, tail


def wait_dequeued(sweep_dir: str, timeout_s: float = 120.0) -> bool:
    """Wait until the sweep's jobs have left squeue (wait=true returns with rank 0's result, while
    the other tasks and the job's epilogue may still run); False on timeout or without squeue."""
    jobs = {p["job_id"] for p in read_submitted(sweep_dir)["points"] if p.get("job_id")}
    deadline = time.monotonic() + timeout_s
    while jobs:
        try:
            out = subprocess.run(["squeue", "-h", "-r", "-o", "%i"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return False
        if out.returncode != 0 or not jobs & set(out.stdout.split()):
            return out.returncode == 0
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def points_by_name(sweep_dir: str, group: str) -> dict[str, dict[str, Any]]:
    """submitted.json's points keyed by their option of `group` (from `+group=name`)."""
    out = {}
    for point in read_submitted(sweep_dir)["points"]:
        for o in point["overrides"].split():
            if override_key(o) == group:
                out[o.split("=", 1)[1]] = point
    return out


def measured(run_dir: str) -> Optional[dict[str, Any]]:
    """A finished run's steady numbers: the median over its train lines after the first
    (warm-up) step of tokens/s (whole job) and step time, and the mean phase times
    (megaft.training.phases); None without summary.json."""
    summary = RunSummary.read(run_dir)
    if summary is None:
        return None
    train = [rec for rec in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
             if "loss" in rec and rec.get("tokens_per_s")]
    steady = train[1:] or train
    world = summary.world_size
    tokens_per_step = summary.tokens / max(summary.steps, 1)
    if steady:
        tps = statistics.median(float(rec["tokens_per_s"]) for rec in steady)
        step_s = statistics.median(tokens_per_step / float(rec["tokens_per_s"]) for rec in steady)
    else:
        tps = summary.tokens_per_s
        step_s = tokens_per_step / tps if tps else None
    out = {"tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world if tps else None, "step_s": step_s,
           "world_size": world, "steps": summary.steps, "steady_steps": len(steady),
           "final_loss": summary.final_loss}
    for key in PHASE_KEYS:
        values = [float(rec[key]) for rec in steady if key in rec]
        out[key] = statistics.fmean(values) if values else None
    return out
