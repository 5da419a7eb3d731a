"""The report's table and files: an aligned text table, report.csv, report.json, report.md
and report.png (tokens/s and peak memory per config; a scaling study adds scaling.png)."""
from __future__ import annotations

import csv
import json
import os
from typing import Any, Optional

from megaft.report.collect import COLUMNS
from megaft.report.evalscores import eval_columns
from megaft.training.phases import PHASE_KEYS


def cell(key: str, value: Any) -> str:
    """One value as the table shows it ("-" when missing)."""
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
    cells = [[cell(c, v if c != "overrides" else o) for c, v in ((c, r[c]) for c in cols)]
             for r, o in zip(rows, shown)]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    lines = [f"common overrides: {common or '-'}", "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in cells]
    lines += [f"{r['run']}: {r['status']}: {r['reason']}" for r in rows if r["reason"]]
    return "\n".join(lines)


def columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """COLUMNS, plus a scaling study's (megaft.scale.report) and the communication
    prediction's (megaft.plan.run_comm) when the rows carry them, then megaft-eval's
    scores (megaft.report.evalscores)."""
    from megaft.plan.run_comm import COMM_COLUMNS
    from megaft.scale.report import SCALE_COLUMNS

    extra = (SCALE_COLUMNS if rows and "speedup" in rows[0] else ()) + (
        COMM_COLUMNS if rows and "pred_comm_s" in rows[0] else ())
    return COLUMNS + tuple(dict.fromkeys(extra)) + eval_columns(rows)  # both have comm_share: once


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
        f.writelines("| " + " | ".join(cell(c, r[c]).replace("|", "\\|") for c in cols) + " |\n" for r in rows)
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
