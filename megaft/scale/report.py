"""What `megaft-report` adds for a scaling study's sweep dir (one with scale.json).

Columns, per run, from its metrics.jsonl after the first (warm-up) step
(megaft.plan.multirun.measured: medians of the step time and the whole job's tokens/s):

* nodes: the study's node count of the run (megaft.scale.study);
* step_s, steady_tokens_per_s: the median step time and throughput;
* speedup: steady tokens/s over that of the base run (the fewest nodes that finished).
  Under strong scaling every run does the same work per step, so this is the ratio of
  step times; under weak scaling it is the scaled speedup (N times the work per step);
* ideal: nodes / base nodes; efficiency: speedup / ideal (1 = perfect scaling);
* comm_share: exposed communication over the phased step time, comm_s / (forward_s +
  backward_s + optimizer_s + comm_s) (megaft.training.phases: the dp reduction nothing
  hides, pipeline receive waits and the loss all-reduce).

`scaling.png` plots measured against ideal speedup and the efficiency and communication
share per node count; its PNG text chunk `megaft-scaling` holds the plotted points as JSON.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from megaft.plan.multirun import measured, override_key
from megaft.scale.study import GROUP
from megaft.training.phases import comm_share

SCALE_COLUMNS = ("nodes", "step_s", "steady_tokens_per_s", "speedup", "ideal", "efficiency", "comm_share")
PERCENT = ("efficiency", "comm_share")
PNG_KEY = "megaft-scaling"


def point_name(overrides: str) -> Optional[str]:
    return next((o.split("=", 1)[1] for o in overrides.split() if override_key(o) == GROUP), None)


def add_scaling(rows: list[dict[str, Any]], root: str, study: dict[str, Any]) -> list[dict[str, Any]]:
    """`rows` (megaft.report.collect over `root`) with SCALE_COLUMNS filled in place."""
    nodes_of = {p["name"]: p["nodes"] for p in study["points"]}
    for row in rows:
        row.update({c: None for c in SCALE_COLUMNS})
        row["nodes"] = nodes_of.get(point_name(row["overrides"] or ""))
        meas = measured(os.path.join(root, row["run"])) if row["status"] == "done" else None
        if not meas:
            continue
        row.update(step_s=meas["step_s"], steady_tokens_per_s=meas["tokens_per_s"])
        row["comm_share"] = comm_share(meas)
    done = [r for r in rows if r["nodes"] and r["steady_tokens_per_s"]]
    if done:
        base = min(done, key=lambda r: r["nodes"])
        for row in done:
            row["speedup"] = row["steady_tokens_per_s"] / base["steady_tokens_per_s"]
            row["ideal"] = row["nodes"] / base["nodes"]
            row["efficiency"] = row["speedup"] / row["ideal"]
    return rows


def plot_scaling(rows: list[dict[str, Any]], study: dict[str, Any], path: str) -> str:
    """scaling.png: measured and ideal speedup, efficiency and communication share per node count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted((r for r in rows if r["speedup"] is not None), key=lambda r: r["nodes"])
    data = {"mode": study["mode"], "ranks_per_node": study["ranks_per_node"],
            "points": [{k: r[k] for k in ("nodes", "speedup", "ideal", "efficiency", "comm_share", "step_s")}
                       for r in pts]}
    x = [r["nodes"] for r in pts]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(x, [r["ideal"] for r in pts], "--", color="C7", label="ideal")
    left.plot(x, [r["speedup"] for r in pts], "o-", color="C0", label="measured")
    xlabel = f"nodes ({study['ranks_per_node']} rank(s) each)"
    left.set(xlabel=xlabel, ylabel="speedup", title=f"{study['mode']} scaling")
    right.plot(x, [100 * r["efficiency"] for r in pts], "o-", color="C0", label="efficiency")
    right.plot(x, [100 * (r["comm_share"] or 0.0) for r in pts], "s-", color="C3", label="communication share")
    right.axhline(100, ls="--", color="C7")
    right.set(xlabel=xlabel, ylabel="%", title="efficiency and exposed communication")
    for ax in (left, right):
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={PNG_KEY: json.dumps(data)})
    plt.close(fig)
    return path
