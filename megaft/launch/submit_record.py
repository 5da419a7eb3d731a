"""`submitted.json` in a sweep dir: what the Slurm launcher submitted, for megaft-report.

{"points": [{"num", "overrides", "run_dir", "status": "submitted" | "invalid",
             "problems" (invalid), "job_id" ("<array>_<task>"), "array_job_id",
             "shape" {nodes, tasks_per_node, gpus_per_node, cpus_per_task, world_size},
             "submitit_folder" (the job's logs and result pickle),
             "eval_job_id" (train.then_eval: its megaft-eval job, megaft.eval.submit),
             "score_job_id" (pref.scores, distill.scores: the scoring job it waits for, score_jobs)}, ...],
 "arrays": [{"array_job_id", "shape", "points": [num, ...]}, ...]}
"""
from __future__ import annotations

import json
import os
from typing import Any

from megaft.fileio import write_json_atomic

SUBMITTED_FILE = "submitted.json"


def read_submitted(sweep_dir: str) -> dict[str, Any]:
    """The sweep dir's record, or an empty one."""
    path = os.path.join(sweep_dir, SUBMITTED_FILE)
    if not os.path.isfile(path):
        return {"points": [], "arrays": []}
    with open(path) as f:
        return json.load(f)


def merge_submitted(sweep_dir: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Add `records` (a later batch of the same sweep replaces points of equal num) and
    rewrite the file atomically; returns the whole record."""
    data = read_submitted(sweep_dir)
    points = {p["num"]: p for p in data["points"]}
    points.update({r["num"]: r for r in records})
    arrays: dict[str, dict[str, Any]] = {}
    for p in sorted(points.values(), key=lambda p: p["num"]):
        if p["status"] == "submitted":
            entry = arrays.setdefault(p["array_job_id"], {"array_job_id": p["array_job_id"], "shape": p["shape"],
                                                          "points": []})
            entry["points"].append(p["num"])
    data = {"points": sorted(points.values(), key=lambda p: p["num"]), "arrays": list(arrays.values())}
    write_json_atomic(os.path.join(sweep_dir, SUBMITTED_FILE), data)
    return data
