"""`megaft-report DIR --commbench CB`: each finished run's communication share next to what
the bandwidth megaft-commbench measured predicts for it.

Measured, from the run's phase times (megaft.training.phases.comm_share): exposed
communication over the phased step, comm_s / (forward_s + backward_s + optimizer_s + comm_s).
Predicted: the config the run ran with (its config.yaml, written after elastic changes and
re-plans: megaft.training.run_config; Hydra's .hydra/config.yaml for runs from before it) on
its world size, costed by the planner's model (megaft.perf.time) with the cluster's links
replaced by the measured ones (`cluster.measured`, megaft.plan.measured). comm_s is the time
nothing hid (the dp reduction left after backward, pipeline receive waits), so the prediction
it stands next to is the same group of terms megaft-plan's probe compares it with: dp_comm + pp_bubble
(megaft.plan.probe.TERM_GROUPS, "exposed comm"), over the predicted step.

The compute side of the prediction (what hides the reduction, what the step takes) comes
from a cluster preset: the run's own `cluster=` when it had one, else `--cluster NAME`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from megaft.config import Config, compose_config, conf_dir
from megaft.perf.time import step_cost
from megaft.plan.measured import apply_measured
from megaft.plan.probe import TERM_GROUPS
from megaft.plan.shape import planning_config
from megaft.training.phases import comm_share
from megaft.training.run_config import load_config, read_run_config

COMM_COLUMNS = ("comm_share", "pred_comm_s", "pred_comm_share")
EXPOSED = next(terms for name, terms, _ in TERM_GROUPS if name == "exposed comm")


def preset_cluster(name: str):
    """The ClusterConfig of conf/cluster/<name>.yaml (ValueError naming the presets otherwise)."""
    try:
        return compose_config([f"cluster={name}"]).cluster
    except Exception as exc:  # Hydra's "Could not find 'cluster/x'" and its kin
        presets = sorted(f[:-5] for f in os.listdir(_cluster_dir()) if f.endswith(".yaml"))
        raise ValueError(f"--cluster {name}: no such preset ({type(exc).__name__}); fix: one of "
                         f"{', '.join(presets)}") from exc


def _cluster_dir() -> str:
    return os.path.join(conf_dir(), "cluster")


def check_commbench(measured: str, cluster) -> list[str]:
    """Problems of --commbench, checked once before any run is read."""
    # comm_fraction only scales what is stored; a preset-less check must not divide by its 0
    problems = apply_measured(dataclasses.replace(cluster, measured=measured,
                                                  comm_fraction=cluster.comm_fraction or 1.0))[2]
    return [p.replace(f"cluster.measured={measured!r}", f"--commbench {measured}")
            .replace("point cluster.measured at", "point --commbench at") for p in problems]


def run_config(run_dir: str) -> Config:
    """The Config the run ran with (config.yaml), else as megaft-train composed it (.hydra/config.yaml)."""
    ran = read_run_config(run_dir)
    if ran is not None:
        return ran.config
    path = os.path.join(run_dir, ".hydra", "config.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing (a run not started by megaft-train); nothing to predict from")
    return load_config(path)


def predict(run_dir: str, world_size: int, measured: str, cluster=None) -> dict[str, float]:
    """{pred_comm_s, pred_step_s, pred_comm_share} of the run on `world_size` ranks, with the
    links of the megaft-commbench run `measured`; `cluster`: the preset when the run has none."""
    cfg = run_config(run_dir)
    base = cfg.cluster if cfg.cluster.gpus_per_node > 0 else cluster
    if base is None:
        raise ValueError("the run names no cluster (it ran without cluster=...); fix: megaft-report ... "
                         "--cluster <preset> (conf/cluster/: cpu, h100, ...) for its compute and memory figures")
    shaped, problems = planning_config(dataclasses.replace(cfg, cluster=dataclasses.replace(base, measured=measured)))
    if problems:
        raise ValueError("; ".join(problems))
    cost = step_cost(shaped, shaped.cluster, world_size)
    comm = sum(cost.terms[t] for t in EXPOSED)
    return {"pred_comm_s": comm, "pred_step_s": cost.step_s, "pred_comm_share": comm / cost.step_s}


def add_comm(rows: list[dict[str, Any]], root: str, measured: str, cluster=None) -> list[dict[str, Any]]:
    """`rows` (megaft.report.collect over `root`) with COMM_COLUMNS filled in place: the measured
    share for every run with phase times, the prediction for every finished one; why a
    prediction is missing goes to the row's reason."""
    for row in rows:
        row.update({c: None for c in COMM_COLUMNS})
        row["comm_share"] = comm_share(row)
        if row["status"] != "done":
            continue
        try:
            prediction = predict(os.path.join(os.path.abspath(root), row["run"]), int(row["world_size"] or 1),
                                 measured, cluster)
        except (ValueError, OSError) as exc:
            row["reason"] = row["reason"] or f"no communication prediction: {exc}"
            continue
        row["pred_comm_s"], row["pred_comm_share"] = prediction["pred_comm_s"], prediction["pred_comm_share"]
    return rows


def prediction_line(rows: list[dict[str, Any]]) -> Optional[str]:
    """One line under the table: measured against predicted share, per finished run."""
    pairs = [(r["run"], r["comm_share"], r["pred_comm_share"]) for r in rows
             if r.get("comm_share") is not None and r.get("pred_comm_share") is not None]
    if not pairs:
        return None
    return "communication share, measured vs predicted from the measured bandwidth: " + ", ".join(
        f"{run} {got:.1%} vs {want:.1%}" for run, got, want in pairs)
