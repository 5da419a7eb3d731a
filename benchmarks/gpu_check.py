"""`make gpu-check`: everything megaft has not yet run on a GPU, in one command that fits
the minutes a borrowed GPU gives (8 by default, one H100).

    python -m benchmarks.gpu_check [--budget 480] [--out benchmarks/results]

On a machine with a CUDA GPU it runs, each under its own time budget and all within
`--budget` seconds: the carried wheels' install (megaft's pure-Python dependencies that a
GPU image may lack, from .gpu-wheels/: `make gpu-wheels` fills it), the CUDA extension's
build for this GPU, `pytest -m gpu tests`, the kernel benchmarks (every kernel against
torch), fused AdamW against its byte floor, Muon's Newton-Schulz paths against torch's
(benchmarks.newton_schulz), a 1B-model train step (tokens/s and MFU) and the memory
estimate against torch.cuda.max_memory_allocated. A step that runs out of time is stopped
and recorded as a timeout; the rest still run. The results go to
`<out>/<date>-<gpu>.json` (every step's command, status, seconds and output tail, and the
benchmarks' own JSON rows) and a summary table is printed. Without a GPU it says so in
one line and exits 0. Exit status 1 when a step failed or timed out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAIL = 4000  # characters of each step's output kept in the results file
WHEELS = os.path.join(ROOT, ".gpu-wheels")


@dataclass
class Step:
    """One command of the check; `{out}` in it is the folder of this run's files."""

    name: str
    cmd: list
    budget_s: float
    env: dict = field(default_factory=dict)
    json_out: Optional[str] = None  # a file the command writes under {out}, kept in the results


def gpu_name() -> tuple[Optional[str], str]:
    """(the first CUDA device's name, or None; why there is none)."""
    try:
        import torch
    except ImportError:
        return None, f"{sys.executable} has no torch"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__}: torch.cuda.is_available() is False"
    return torch.cuda.get_device_name(0), ""


def steps(arch: str) -> list[Step]:
    """The check's steps for a GPU of compute capability `arch` ("9.0"), 480 s in all."""
    py = sys.executable
    return [
        Step("wheels", [py, "-m", "pip", "install", "--no-index", "--find-links", WHEELS, "-r",
                        os.path.join(ROOT, "requirements-gpu.txt")], 30),
        Step("build", [py, "setup.py", "build_ext", "--inplace"], 100,
             env={"MEGAFT_BUILD_CUDA": "1", "TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(os.cpu_count() or 4)}),
        Step("pytest_gpu", [py, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider",
                            "--junitxml", "{out}/pytest_gpu.xml"], 130),
        Step("kernels", [py, "-m", "benchmarks.kernels", "--device", "cuda", "--reps", "20",
                         "--json", "{out}/kernels.json"], 60, json_out="kernels.json"),
        Step("adamw", [py, "-m", "benchmarks.kernels.adamw", "--device", "cuda", "--json", "{out}/adamw.json"], 30,
             json_out="adamw.json"),
        Step("newton_schulz", [py, "-m", "benchmarks.newton_schulz", "--device", "cuda", "--json",
                               "{out}/newton_schulz.json"], 20, json_out="newton_schulz.json"),
        Step("train_step_1b", [py, "-m", "benchmarks.train_step", "--model", "1b", "--precision", "bf16",
                               "--steps", "6"], 70),
        Step("memory", [py, "-m", "benchmarks.memory", "--device", "cuda", "--precision", "bf16", "--skip-ranks",
                        "--rounds", "2"], 40),
    ]


def run_steps(plan: list[Step], budget_s: float, out: str) -> list[dict]:
    """Run `plan` in order, each within its budget and what is left of `budget_s`; a row per step."""
    os.makedirs(out, exist_ok=True)
    deadline, rows = time.monotonic() + budget_s, []
    for step in plan:
        left = deadline - time.monotonic()
        row = {"name": step.name, "cmd": " ".join(c.replace("{out}", out) for c in step.cmd),
               "budget_s": step.budget_s}
        if left < 1:
            rows.append({**row, "status": "skipped", "seconds": 0.0, "tail": "no time left in --budget"})
            continue
        limit = min(step.budget_s, left)
        start = time.monotonic()
        try:
            done = subprocess.run([c.replace("{out}", out) for c in step.cmd], cwd=ROOT, capture_output=True,
                                  text=True, timeout=limit, env={**os.environ, **step.env})
            status, rc, text = ("ok" if done.returncode == 0 else "failed"), done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:  # subprocess.run killed it
            status, rc = "timeout", None
            text = _text(exc.stdout) + _text(exc.stderr) + f"\n[stopped after {limit:.0f} s]"
        row.update(status=status, rc=rc, seconds=round(time.monotonic() - start, 1), tail=text[-TAIL:])
        if step.json_out and os.path.isfile(os.path.join(out, step.json_out)):
            with open(os.path.join(out, step.json_out)) as f:
                row["json"] = json.load(f)
        rows.append(row)
        print(f"gpu-check: {step.name:<14} {status:<8} {row['seconds']:7.1f} s", flush=True)
    return rows


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def headline(row: dict) -> str:
    """One line of what a step measured, read from its output (pytest counts, MFU, ...)."""
    tail = row.get("tail", "")
    if row["name"] == "pytest_gpu":
        found = re.findall(r"\d+ (?:passed|failed|skipped|error)\w*", tail)
        return ", ".join(found[-4:])
    found = re.findall(r"(?:MFU|mfu)[^\n]{0,60}", tail)
    return found[-1].strip() if found else tail.strip().splitlines()[-1][:80] if tail.strip() else ""


def summary_table(rows: list[dict]) -> str:
    lines = [f"{'step':<14} {'status':<8} {'s':>7}  result"]
    lines += [f"{r['name']:<14} {r['status']:<8} {r['seconds']:7.1f}  {headline(r)}" for r in rows]
    return "\n".join(lines)


def results_path(out_root: str, gpu: str, when: datetime.date) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return os.path.join(out_root, f"{when.isoformat()}-{slug}.json")


def write_results(path: str, gpu: str, rows: list[dict], budget_s: float) -> dict:
    doc = {"schema": 1, "date": datetime.date.today().isoformat(), "gpu": gpu, "budget_s": budget_s,
           "command": "make gpu-check", "commit": _commit(), "steps": rows, "versions": _versions()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return doc


def _commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--only", help="comma-separated step names (default: all)")
    args = parser.parse_args(argv)
    gpu, why = gpu_name()
    if gpu is None:
        print(f"gpu-check: no CUDA GPU here ({why}): nothing to check")
        return 0
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    plan = [s for s in steps(f"{major}.{minor}") if not args.only or s.name in args.only.split(",")]
    if not os.path.isdir(WHEELS):
        plan = [s for s in plan if s.name != "wheels"]
    path = results_path(args.out, gpu, datetime.date.today())
    rows = run_steps(plan, args.budget, path[:-len(".json")])
    write_results(path, gpu, rows, args.budget)
    print(summary_table(rows))
    print(f"gpu-check: {path}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
