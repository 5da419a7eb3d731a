"""curves.png: the training and eval loss curves of every run on one figure (one line per
run, named by the overrides that set it apart), beside report.png (and scaling.png).

The plotted points are stored with the figure, as scaling.png's are: in its PNG text chunk
`megaft-curves`, and in curves.json beside it: {"common": the overrides every run shares,
"runs": [{"run", "label", "train": [[step, loss], ...], "eval": [[step, eval_loss], ...]}]},
read from each run's metrics.jsonl (runs without one are left out). A GRPO run (train.objective=
grpo) also has "reward": [[step, mean reward], ...], drawn in a third panel.
"""
from __future__ import annotations

import json
import os
import textwrap
from typing import Any

from megaft.fileio import read_jsonl
from megaft.report.render import short_overrides

PNG_KEY = "megaft-curves"
FILE = "curves.png"


def curve_points(rows: list[dict[str, Any]], root: str) -> dict[str, Any]:
    """The curves of the report's rows (run dirs relative to `root`), as curves.json holds them."""
    labels, common = short_overrides(rows)
    runs = []
    for row, label in zip(rows, labels):
        metrics = read_jsonl(os.path.join(os.path.abspath(root), row["run"], "metrics.jsonl"))
        train = [[m["step"], m["loss"]] for m in metrics if "loss" in m and "step" in m]
        evals = [[m["step"], m["eval_loss"]] for m in metrics if "eval_loss" in m and "step" in m]
        rewards = [[m["step"], m["reward"]] for m in metrics if "reward" in m and "step" in m]
        if train or evals:
            runs.append({"run": row["run"], "label": label or row["run"], "train": train, "eval": evals,
                         **({"reward": rewards} if rewards else {})})
    return {"common": common, "runs": runs}


def plot_curves(rows: list[dict[str, Any]], root: str, out_dir: str) -> list[str]:
    """curves.png and curves.json in out_dir (nothing when no run has metrics); their paths."""
    data = curve_points(rows, root)
    if not data["runs"]:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rewards = any("reward" in run for run in data["runs"])
    fig, axes = plt.subplots(1, 3 if rewards else 2, figsize=(16 if rewards else 11, 4.5))
    panels = list(zip(axes, ("train", "eval", "reward"), ("training loss", "eval loss", "mean reward (GRPO)")))
    for i, run in enumerate(data["runs"]):
        color = f"C{i % 10}"  # the same run has the same color in every panel
        for ax, key, _ in panels:
            if run.get(key):
                steps, values = zip(*run[key])
                ax.plot(steps, values, "o-" if key == "eval" else "-", color=color, label=run["label"], ms=3)
    for ax, key, title in panels:
        ax.set(xlabel="step", ylabel="reward" if key == "reward" else "loss", title=title)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(f"megaft-report loss curves; common overrides: {data['common'] or '-'}", 160),
                 fontsize=8)
    fig.tight_layout()
    png = os.path.join(out_dir, FILE)
    fig.savefig(png, dpi=100, metadata={PNG_KEY: json.dumps(data)})
    plt.close(fig)
    path = os.path.join(out_dir, "curves.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return [png, path]
