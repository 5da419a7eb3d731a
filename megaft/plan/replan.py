"""Elastic restart on a world that tp·pp·cp no longer divides: re-plan the layout (issue 17).

megaft.launch.elastic keeps tp, pp and cp and lets dp follow the world a restarted job
gets. When they no longer divide it (4 ranks of tp=4 restarted on 2, or 3 ranks left),
`megaft-train` asks the planner (megaft.plan.space.search) for the fastest valid layout
of the world it got, when the run names a cluster (`cluster=<preset>`, as megaft-plan
does; the planner's costs and memory budget come from it). Without a cluster there is
no planner to ask and the restart stops with ElasticError's message. The new layout's
tp, cp, pp, dp, ep (a mixture of experts': searched as megaft-plan does), vpp, ZeRO stage,
offload, micro-batch size and recompute replace the run's; train.global_batch_size stays,
and the newest checkpoint reshards to the new layout on load (megaft.checkpoint.reshard),
as on any resume with another layout.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from megaft.config import Config

log = logging.getLogger("megaft")


def planning_cluster(cfg: Config, world: int):
    """cfg.cluster resized to `world` ranks: the job's node count (SLURM_NNODES) when it divides
    the world, else one node holding them all."""
    nodes = int(os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES") or 1)
    if nodes < 1 or world % nodes:
        nodes = 1
    return dataclasses.replace(cfg.cluster, nodes=nodes, gpus_per_node=world // nodes)


def replan(cfg: Config, world: int, why: str) -> Optional[str]:
    """Re-plan cfg's layout for `world` ranks in place; returns the message printed, or None when no
    planner can be asked (no cluster named) or it finds no valid layout (`why` stays the error)."""
    if cfg.cluster.gpus_per_node < 1:
        return None
    from megaft.plan.shape import planning_config
    from megaft.plan.space import apply_layout, search

    cluster = planning_cluster(cfg, world)
    shaped, problems = planning_config(dataclasses.replace(cfg, cluster=cluster))
    if problems:
        log.warning("megaft: elastic re-plan impossible: %s", "; ".join(problems))
        return None
    cluster = shaped.cluster  # with cluster.measured, the measured links
    result = search(shaped, cluster, cfg.plan)
    if not result.ranked:
        return None
    layout = result.ranked[0].layout
    new = apply_layout(cfg, layout)
    cfg.parallel, cfg.train, cfg.model = new.parallel, new.train, new.model
    msg = (f"megaft: elastic restart re-planned: {why.split(';')[0].removeprefix('launcher.elastic: ')}; the "
           f"planner (cluster={cluster.name}, {cluster.nodes} x {cluster.gpus_per_node} ranks) chose "
           f"{layout.short()}, global batch {cfg.train.global_batch_size} kept; the checkpoint is resharded")
    log.warning(msg)
    print(msg, flush=True)
    return msg
