"""Finding the runs under a directory and one report row per run: its status, and its
numbers from summary.json (RunSummary), else from the metrics written so far; MFU through
megaft.perf (the one place FLOPs are counted)."""
from __future__ import annotations

import os
import statistics
from typing import Any, Optional

import yaml

from megaft.fileio import read_jsonl
from megaft.launch.submit_record import read_submitted
from megaft.perf.counts import flops_per_token_from_params, mfu
from megaft.perf.hardware import peak_tflops
from megaft.report import status
from megaft.report.evalscores import add_eval_scores
from megaft.run_dir import is_run_dir
from megaft.training.phases import PHASE_KEYS
from megaft.training.summary import RunSummary

COLUMNS = ("run", "overrides", "status", "job_id", "world_size", "tp", "pp", "dp", "tokens_per_s", "mfu",
           *PHASE_KEYS, "peak_mem_gb", "final_loss", "eval_loss", "eval_accuracy", "kernels", "reason")
SKIP_DIRS = {".submitit", ".hydra", "checkpoints", "hf", "eval", ".scores"}  # .scores: pref.scores' scoring jobs


def find_runs(root: str) -> list[dict[str, Any]]:
    """Entries {run_dir, overrides, job_id?, submitit_folder?, status?, problems?}: the points of
    submitted.json first (in submission order), then every other run dir under root."""
    root = os.path.abspath(root)
    entries = {os.path.abspath(p["run_dir"]): dict(p) for p in read_submitted(root)["points"]}
    candidates = [root] if is_run_dir(root) else []
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        if dirpath != root and is_run_dir(dirpath):
            candidates.append(dirpath)
            dirnames[:] = []  # a run dir's subfolders are its own outputs
    for path in candidates:
        entries.setdefault(path, {"run_dir": path, "overrides": _hydra_overrides(path)})
    return list(entries.values())


def _hydra_overrides(run_dir: str) -> str:
    path = os.path.join(run_dir, ".hydra", "overrides.yaml")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        return " ".join(yaml.safe_load(f) or [])


def collect(root: str, peak: Optional[float] = None) -> list[dict[str, Any]]:
    """One row (COLUMNS) per run under `root`; `peak` overrides the GPU table (TFLOP/s)."""
    states = status.squeue_states()
    rows = []
    entries = find_runs(root)
    for entry in entries:
        run_dir = entry["run_dir"]
        summary = RunSummary.read(run_dir)
        metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        row: dict[str, Any] = {c: None for c in COLUMNS}
        row.update(run=os.path.relpath(run_dir, os.path.abspath(root)), overrides=entry.get("overrides", ""),
                   job_id=entry.get("job_id"), status=status.run_status(entry, summary, bool(metrics), states))
        if row["status"] == "invalid":
            row["reason"] = "; ".join(entry.get("problems", []))
        elif row["status"] == "failed":
            row["reason"] = status.failure_reason(entry)
        row.update(_numbers(summary, metrics, entry, peak))
        rows.append(row)
    add_eval_scores(rows, [e["run_dir"] for e in entries])  # megaft-eval's columns: <task>/<metric>
    return rows


def _numbers(summary: Optional[RunSummary], metrics: list[dict], entry: dict,
             peak: Optional[float]) -> dict[str, Any]:
    """Throughput, MFU, memory and losses: from summary.json, else the metrics so far."""
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m or "eval_accuracy" in m]
    s = summary or RunSummary()  # no summary: every number below is None
    out: dict[str, Any] = {k: getattr(s, k) for k in ("world_size", "tp", "pp", "dp", "tokens_per_s", "final_loss",
                                                      "eval_loss", "eval_accuracy")}
    if out["world_size"] is None and entry.get("shape"):
        out["world_size"] = entry["shape"]["world_size"]
    if summary is None and train:
        # The first step includes warm-up; the median of the rest is the steady rate.
        out["tokens_per_s"] = statistics.median(m["tokens_per_s"] for m in train[1:] or train)
        out["final_loss"] = train[-1]["loss"]
    if summary is None and evals:
        out["eval_loss"], out["eval_accuracy"] = evals[-1].get("eval_loss"), evals[-1].get("eval_accuracy")
    mem = s.peak_memory_bytes if s.peak_memory_bytes is not None else s.peak_rss_bytes
    out["peak_mem_gb"] = mem / 2**30 if mem is not None else None
    out["mfu"] = run_mfu(s, out["tokens_per_s"], peak)
    out["kernels"] = kernels_cell(s.kernels)
    steady = train[1:] or train  # the first step includes warm-up
    for key in PHASE_KEYS:
        values = [m[key] for m in steady if key in m]
        out[key] = statistics.fmean(values) if values else None
    return out


def run_mfu(summary: RunSummary, tokens_per_s: Optional[float], peak: Optional[float]) -> Optional[float]:
    """MFU of a run: the given peak, else the run's own, else its GPU's; None without one (CPU)."""
    if not tokens_per_s:
        return None
    peak = peak or summary.peak_tflops
    if not peak and str(summary.device or "").startswith("cuda"):
        peak = peak_tflops(summary.device_name, summary.precision or "bf16")  # bf16: summaries without it
    fpt = summary.flops_per_token
    shape = (summary.params, summary.n_layers, summary.dim, summary.seq_len)
    if fpt is None and all(v is not None for v in shape):  # summaries from before flops_per_token
        fpt = flops_per_token_from_params(*shape)
    if not peak or fpt is None or summary.world_size is None:
        return None
    return mfu(tokens_per_s, fpt, summary.world_size, peak)


def kernels_cell(record: Optional[dict]) -> Optional[str]:
    """summary.json's {op: {"backend": ...}} as "torch" (one backend for every op) or
    "triton(rmsnorm,rope) torch(linear)"; None for summaries without it."""
    if not isinstance(record, dict) or not record:
        return None
    groups: dict[str, list[str]] = {}
    for op, entry in record.items():
        groups.setdefault(str(entry.get("backend", "?")) if isinstance(entry, dict) else "?", []).append(op)
    if len(groups) == 1:
        return next(iter(groups))
    return " ".join(f"{backend}({','.join(ops)})" for backend, ops in groups.items())
