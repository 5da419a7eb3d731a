"""`megaft-report DIR`: one table row per run of a run dir or a sweep dir.

Reads each run's summary.json and metrics.jsonl, the sweep's submitted.json (job ids,
invalid points with their problems) and, when Slurm answers, `squeue` (sacct is not
needed). Prints the table, writes report.csv, report.json, report.md and a plot
report.png (tokens/s and peak memory per config) into DIR (or --out).

Status: invalid (rejected before submission), pending / running (in squeue, or for
runs Slurm does not know: no metrics yet / metrics but no summary), done (summary.json),
failed (a submitted job that left squeue without a summary; the reason comes from
submitit's result pickle or the job's stderr).

MFU = tokens/s * model FLOPs per token / (ranks * peak FLOP/s), from megaft.perf.counts
(the PaLM paper's count: matmuls forward and backward plus attention scores and values).
The peak is --peak-tflops, else the run's train.peak_tflops, else the dense peak of the
run's GPU at its precision; runs on CPU without a given peak show "-". The phase columns
(forward/backward/optimizer/comm seconds per step) are means over the train lines of
metrics.jsonl after the first (warm-up) step. The kernels column is summary.json's
`kernels` record in short: the one backend every op ran, else `backend(op,...)` groups
(why each was chosen, and the measured times, stay in summary.json).

A scaling study's sweep dir (`megaft-scale`, with scale.json) gets the columns nodes,
step_s, steady_tokens_per_s, speedup, ideal, efficiency and comm_share, and scaling.png
(measured against ideal speedup); megaft.scale.report defines them.

`--commbench <megaft-commbench run dir>` adds comm_share (measured, as above), pred_comm_s
and pred_comm_share: what the cost model predicts for each finished run's own config when
the links are the measured ones (megaft.plan.run_comm; `--cluster <preset>` for runs that
ran without `cluster=`).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import pickle
import statistics
import subprocess
import sys
from typing import Any, Optional

import yaml

from megaft.fileio import read_json, read_jsonl
from megaft.launch.submit_record import read_submitted
from megaft.perf.counts import flops_per_token_from_params, mfu
from megaft.perf.hardware import peak_tflops
from megaft.training.phases import PHASE_KEYS

COLUMNS = ("run", "overrides", "status", "job_id", "world_size", "tp", "pp", "dp", "tokens_per_s", "mfu",
           *PHASE_KEYS, "peak_mem_gb", "final_loss", "eval_loss", "eval_accuracy", "kernels", "reason")
RUN_FILES = ("summary.json", "metrics.jsonl", os.path.join(".hydra", "config.yaml"))
SKIP_DIRS = {".submitit", ".hydra", "checkpoints", "hf"}


def _is_run_dir(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in RUN_FILES)


def find_runs(root: str) -> list[dict[str, Any]]:
    """Entries {run_dir, overrides, job_id?, submitit_folder?, status?, problems?}: the points of
    submitted.json first (in submission order), then every other run dir under root."""
    root = os.path.abspath(root)
    entries = {os.path.abspath(p["run_dir"]): dict(p) for p in read_submitted(root)["points"]}
    candidates = [root] if _is_run_dir(root) else []
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        if dirpath != root and _is_run_dir(dirpath):
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


def squeue_states() -> Optional[dict[str, str]]:
    """{job id as submitit names it ("123" or "123_4"): state} of queued jobs, None without Slurm."""
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return dict(line.split("|", 1) for line in out.stdout.split() if "|" in line)


def failure_reason(entry: dict[str, Any]) -> str:
    """The last line of the job's error: submitit's result pickle, else its stderr log."""
    folder, job = entry.get("submitit_folder"), entry.get("job_id")
    if not folder or not job:
        return ""
    try:
        with open(os.path.join(folder, f"{job}_0_result.pkl"), "rb") as f:  # submitit: {job}_{task}_result.pkl
            outcome, value = pickle.load(f)
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


def run_status(entry: dict[str, Any], summary: Optional[dict], has_metrics: bool,
               states: Optional[dict[str, str]]) -> str:
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


def collect(root: str, peak: Optional[float] = None) -> list[dict[str, Any]]:
    """One row (COLUMNS) per run under `root`; `peak` overrides the GPU table (TFLOP/s)."""
    states = squeue_states()
    rows = []
    for entry in find_runs(root):
        run_dir = entry["run_dir"]
        summary = read_json(os.path.join(run_dir, "summary.json"))
        metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        row: dict[str, Any] = {c: None for c in COLUMNS}
        row.update(run=os.path.relpath(run_dir, os.path.abspath(root)), overrides=entry.get("overrides", ""),
                   job_id=entry.get("job_id"), status=run_status(entry, summary, bool(metrics), states))
        if row["status"] == "invalid":
            row["reason"] = "; ".join(entry.get("problems", []))
        elif row["status"] == "failed":
            row["reason"] = failure_reason(entry)
        row.update(_numbers(summary, metrics, entry, peak))
        rows.append(row)
    return rows


def _numbers(summary: Optional[dict], metrics: list[dict], entry: dict, peak: Optional[float]) -> dict[str, Any]:
    """Throughput, MFU, memory and losses: from summary.json, else the metrics so far."""
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m or "eval_accuracy" in m]
    s = summary or {}
    out: dict[str, Any] = {k: s.get(k) for k in ("world_size", "tp", "pp", "dp", "tokens_per_s", "final_loss",
                                                  "eval_loss", "eval_accuracy")}
    if out["world_size"] is None and entry.get("shape"):
        out["world_size"] = entry["shape"]["world_size"]
    if summary is None and train:
        # The first step includes warm-up; the median of the rest is the steady rate.
        out["tokens_per_s"] = statistics.median(m["tokens_per_s"] for m in train[1:] or train)
        out["final_loss"] = train[-1]["loss"]
    if summary is None and evals:
        out["eval_loss"], out["eval_accuracy"] = evals[-1].get("eval_loss"), evals[-1].get("eval_accuracy")
    mem = s.get("peak_memory_bytes", s.get("peak_rss_bytes"))
    out["peak_mem_gb"] = mem / 2**30 if mem is not None else None
    out["mfu"] = _mfu(s, out["tokens_per_s"], peak)
    out["kernels"] = kernels_cell(s.get("kernels"))
    steady = train[1:] or train  # the first step includes warm-up
    for key in PHASE_KEYS:
        values = [m[key] for m in steady if key in m]
        out[key] = statistics.fmean(values) if values else None
    return out


def _mfu(summary: dict, tokens_per_s: Optional[float], peak: Optional[float]) -> Optional[float]:
    """MFU of a run: the given peak, else the run's own, else its GPU's; None without one (CPU)."""
    if not tokens_per_s:
        return None
    peak = peak or summary.get("peak_tflops")
    if not peak and str(summary.get("device", "")).startswith("cuda"):
        peak = peak_tflops(summary.get("device_name"), summary.get("precision", "bf16"))
    fpt = summary.get("flops_per_token")
    if fpt is None and all(summary.get(k) is not None for k in ("params", "n_layers", "dim", "seq_len")):
        fpt = flops_per_token_from_params(summary["params"], summary["n_layers"], summary["dim"], summary["seq_len"])
    if not peak or fpt is None or summary.get("world_size") is None:
        return None
    return mfu(tokens_per_s, fpt, summary["world_size"], peak)


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


def _cell(key: str, value: Any) -> str:
    if value is None or value == "":
        return "-"
    if key in ("mfu", "eval_accuracy", "efficiency", "comm_share", "pred_comm_share"):
        return f"{value:.1%}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if key in PHASE_KEYS or key == "pred_comm_s":
        return f"{value:.4f}"
    if isinstance(value, float):
        return f"{value:.4g}" if key != "peak_mem_gb" else f"{value:.2f}"
    return str(value)


def short_overrides(rows: list[dict[str, Any]]) -> tuple[list[str], str]:
    """Each row's overrides without the ones every row shares, and the shared ones."""
    split = [r["overrides"].split() for r in rows]
    if not split:
        return [], ""
    common = set.intersection(*map(set, split))
    return [" ".join(o for o in s if o not in common) for s in split], " ".join(o for o in split[0] if o in common)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table (shared overrides on a line above it)."""
    shown, common = short_overrides(rows)
    cols = [c for c in columns(rows) if c != "reason"]
    cells = [[_cell(c, v if c != "overrides" else o) for c, v in ((c, r[c]) for c in cols)]
             for r, o in zip(rows, shown)]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    lines = [f"common overrides: {common or '-'}", "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in cells]
    lines += [f"{r['run']}: {r['status']}: {r['reason']}" for r in rows if r["reason"]]
    return "\n".join(lines)


def columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """COLUMNS, plus a scaling study's (megaft.scale.report) and the communication
    prediction's (megaft.plan.run_comm) when the rows carry them."""
    from megaft.plan.run_comm import COMM_COLUMNS
    from megaft.scale.report import SCALE_COLUMNS

    extra = (SCALE_COLUMNS if rows and "speedup" in rows[0] else ()) + (
        COMM_COLUMNS if rows and "pred_comm_s" in rows[0] else ())
    return COLUMNS + tuple(dict.fromkeys(extra))  # both have comm_share: once


def write_outputs(rows: list[dict[str, Any]], out_dir: str, plot: bool = True,
                  study: Optional[dict] = None) -> list[str]:
    """report.csv, report.json, report.md (and report.png; for a scaling `study`, scaling.png)
    in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"report.{ext}") for ext in ("csv", "json", "md")]
    cols = columns(rows)
    with open(paths[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    with open(paths[1], "w") as f:
        json.dump(rows, f, indent=2)
    with open(paths[2], "w") as f:
        f.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
        f.writelines("| " + " | ".join(_cell(c, r[c]).replace("|", "\\|") for c in cols) + " |\n" for r in rows)
    if plot:
        paths.append(plot_rows(rows, os.path.join(out_dir, "report.png")))
    if plot and study:
        from megaft.scale.report import plot_scaling

        paths.append(plot_scaling(rows, study, os.path.join(out_dir, "scaling.png")))
    return paths


def plot_rows(rows: list[dict[str, Any]], path: str) -> str:
    """Bar charts of tokens/s and peak memory per config (rows without numbers show empty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['run']} ({r['status']})\n{o}" for r, o in zip(rows, short_overrides(rows)[0])]
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.2 * len(rows)), 7), sharex=True)
    for ax, key, title in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "peak_mem_gb", "peak memory (GiB)")):
        ax.bar(range(len(rows)), [r[key] or 0.0 for r in rows], color=["C0" if r["status"] == "done" else "C7"
                                                                          for r in rows])
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=7)
    axes[0].set_title("megaft-report (grey: not done)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megaft-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a run dir or a multirun/sweep dir")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s per GPU for MFU (default: the run's train.peak_tflops, else its "
                             "GPU's dense peak at its precision)")
    parser.add_argument("--out", default=None, help="where report.* go (default: DIR)")
    parser.add_argument("--no-plot", action="store_true", help="skip report.png")
    parser.add_argument("--commbench", default=None, metavar="RUN_DIR",
                        help="a megaft-commbench run dir (or its commbench.json): add each run's communication "
                             "share predicted from the measured bandwidth (megaft.plan.run_comm)")
    parser.add_argument("--cluster", default=None, metavar="PRESET",
                        help="with --commbench, the conf/cluster preset for runs that ran without cluster=...")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"megaft-report: {args.dir} is not a directory", file=sys.stderr)
        return 1
    cluster = None
    if args.commbench or args.cluster:  # checked once, before any run is read
        from megaft.plan.config import ClusterConfig
        from megaft.plan.run_comm import check_commbench, preset_cluster

        try:
            cluster = preset_cluster(args.cluster) if args.cluster else None
        except ValueError as exc:
            print(f"megaft-report: {exc}", file=sys.stderr)
            return 2
        problems = ([] if args.commbench else ["--cluster goes with --commbench; fix: add --commbench <a "
                                                "megaft-commbench run dir>"])
        problems += check_commbench(args.commbench, cluster or ClusterConfig()) if args.commbench else []
        if problems:
            print("megaft-report: " + "\n".join(problems), file=sys.stderr)
            return 2
    rows = collect(args.dir, args.peak_tflops)
    from megaft.scale.study import read_study

    study = read_study(args.dir)  # a megaft-scale sweep: speedup, efficiency and comm share columns
    if study and rows:
        from megaft.scale.report import add_scaling

        add_scaling(rows, args.dir, study)
    if not rows:
        print(f"megaft-report: no runs under {args.dir} (no summary.json, metrics.jsonl, .hydra/ or "
              "submitted.json)", file=sys.stderr)
        return 1
    comparison = None
    if args.commbench and rows:
        from megaft.plan.run_comm import add_comm, prediction_line

        comparison = prediction_line(add_comm(rows, args.dir, args.commbench, cluster))
    print(format_table(rows))
    if comparison:
        print(comparison)
    for path in write_outputs(rows, args.out or args.dir, plot=not args.no_plot, study=study):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
