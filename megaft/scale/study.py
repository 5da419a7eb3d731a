"""A scaling study's points: one run per node count, as megaft-train overrides.

A "node" is `ranks_per_node` ranks (default 8, one GPU node). Point N runs on
world(N) = N x ranks_per_node ranks with the user's tp, cp and pp, so
dp = world(N) / (tp x cp x pp), and with `place_nodes=true` (default) on N Slurm nodes
(`launcher.nodes=N`). On the single-host CPU Slurm there is one node: `ranks_per_node=1
place_nodes=false` makes N the number of gloo ranks, all on that node (slurm_cpu's
tasks_per_node=0).

* strong: every point trains the same model with the same train.global_batch_size, so
  ideally the step time falls as 1/N;
* weak: the work per rank is fixed: point N's global batch is the given one times
  world(N) / world(first N), so ideally the step time stays and the throughput grows as N.

The study is written to `scale.json` in the sweep dir; megaft-report reads it there.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from megaft.fileio import read_json

SCALE_FILE = "scale.json"
GROUP = "scale_point"
MODES = ("strong", "weak")
# What the points set; the user's own values for these are dropped from the common overrides.
POINT_KEYS = ("parallel.dp", "train.global_batch_size", "launcher.nodes", "launcher.world_size", "launcher.nproc")


def study_points(cfg, mode: str, nodes: list[int], ranks_per_node: int,
                 place_nodes: bool) -> tuple[list[dict], list[str]]:
    """([{name, nodes, world_size, dp, global_batch_size, overrides}, ...], problems) for
    `cfg` (megaft.config.Config: the user's tp/cp/pp, batch sizes)."""
    problems = []
    if mode not in MODES:
        problems.append(f"mode={mode!r} must be one of {', '.join(MODES)}")
    if not nodes or any(n < 1 for n in nodes) or sorted(set(nodes)) != list(nodes):
        problems.append(f"nodes={list(nodes)} must be increasing positive node counts, e.g. nodes=[1,2,4,8]")
    if ranks_per_node < 1:
        problems.append(f"ranks_per_node={ranks_per_node} must be >= 1")
    if problems:
        return [], problems
    par, train = cfg.parallel, cfg.train
    model_ranks = par.tp * par.cp * par.pp
    base_world = nodes[0] * ranks_per_node
    points = []
    for n in nodes:
        world = n * ranks_per_node
        gbs = train.global_batch_size if mode == "strong" else train.global_batch_size * world // base_world
        if mode == "weak" and train.global_batch_size * world % base_world:
            problems.append(f"nodes={n}: weak scaling needs train.global_batch_size={train.global_batch_size} x "
                            f"{world}/{base_world} ranks to be whole; fix: other node counts or global batch")
            continue
        if world % model_ranks:
            problems.append(f"nodes={n}: {world} ranks are not a multiple of tp*cp*pp = {model_ranks}; fix: other "
                            "node counts, ranks_per_node or parallel degrees")
            continue
        dp = world // model_ranks
        if gbs % (train.micro_batch_size * dp):
            problems.append(f"nodes={n}: train.global_batch_size={gbs} is not a multiple of train.micro_batch_size "
                            f"* dp = {train.micro_batch_size} * {dp}; fix: a smaller train.micro_batch_size or a "
                            "larger global batch")
            continue
        overrides = [f"parallel.dp={dp}", f"train.global_batch_size={gbs}"]
        overrides += [f"launcher.nodes={n}"] if place_nodes else []
        points.append({"name": f"n{n}", "nodes": n, "world_size": world, "dp": dp, "global_batch_size": gbs,
                       "overrides": overrides})
    return points, problems


def read_study(sweep_dir: str) -> Optional[dict[str, Any]]:
    """The sweep dir's scale.json, None when it is not a scaling study."""
    return read_json(os.path.join(sweep_dir, SCALE_FILE))
