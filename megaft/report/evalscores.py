"""The report's lm-eval columns: one per task metric of RUN_DIR/eval/results.json
(megaft-eval), named `<task>/<metric>` (`megaft_arith/acc`; a metric under a filter other
than lm_eval's `none` keeps it: `megaft_copy/exact_match@remove_whitespace`). Standard
errors, aliases and sample counts stay in the file."""
from __future__ import annotations

import json
import os
from typing import Any

RESULTS = os.path.join("eval", "results.json")


def eval_scores(run_dir: str) -> dict[str, Any]:
    """{column: value} of a run's eval/results.json; {} when it has none (or an unreadable one)."""
    try:
        with open(os.path.join(run_dir, RESULTS)) as f:
            results = json.load(f).get("results") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    scores = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue  # alias, name, sample_len (no filter part), standard errors
            scores[f"{task}/{metric}" + ("" if filt == "none" else f"@{filt}")] = value
    return scores


def eval_columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The eval columns of `rows` (keys with a slash), in first-seen order."""
    return tuple(dict.fromkeys(k for r in rows for k in r if "/" in k))


def add_eval_scores(rows: list[dict[str, Any]], run_dirs: list[str]) -> None:
    """Every row gets every eval column: its run's score, else None."""
    for row, run_dir in zip(rows, run_dirs):
        row.update(eval_scores(run_dir))
    for key in eval_columns(rows):
        for row in rows:
            row.setdefault(key, None)
