"""Elastic restart: a run (re)started on another number of ranks keeps tp, cp and pp and changes dp.

`launcher.elastic=true` makes dp follow the world a job gets (an explicit parallel.dp
is overridden): dp = world / (tp * cp * pp). Gradient accumulation, global_batch_size /
(micro_batch_size * dp), then keeps the global batch, so the loss curve is the one the
old layout would have had (up to fp32 summation order), and the newest checkpoint is
resharded to the new dp on load (megaft.checkpoint.reshard). A world that tp * cp * pp no
longer divides is re-planned when the run names a cluster (megaft.plan.replan), else an
error naming both. Expert parallelism follows: an ep that no longer divides dp*cp becomes
the largest divisor of it that does (the experts' checkpoint slices reshard too). Without
elastic, an unset parallel.dp already
follows the world; a set one must match it (validation says so). The restarted run's
config.yaml records the new dp and accumulation (megaft.training.run_config); the restart
message takes the old accumulation from the config.yaml the previous attempt left.

`requeue_after_loss`: under Slurm, rank 0 of an elastic job that lost ranks (a node)
requeues it on the nodes that remain. `record_restarts` adds the launcher's restart count to summary.json: the local
launcher's (`launcher.max_restarts`) or Slurm's (SLURM_RESTART_COUNT).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
from typing import Optional

from megaft.checkpoint import io
from megaft.config import Config
from megaft.launch import health
from megaft.launch.preempt import requeue, shrink_requeued
from megaft.training.run_config import read_run_config
from megaft.training.summary import RunSummary

log = logging.getLogger("megaft")


class ElasticError(RuntimeError):
    """The world a restarted job got cannot hold the run's tp * pp."""


def newest_layout(checkpoint_dir: str) -> Optional[tuple[int, dict]]:
    """(step, layout) from the newest checkpoint's manifest (not verified: for messages only)."""
    for step, path in reversed(io.list_checkpoints(checkpoint_dir)):
        try:
            return step, io.read_manifest(path)["layout"]
        except (OSError, ValueError, KeyError):
            continue
    return None


def adapt(cfg: Config, world: int, run_dir: str) -> Optional[str]:
    """With launcher.elastic, set cfg.parallel.dp for a world of `world` ranks; returns a message
    describing the change against the newest checkpoint (None when nothing changed)."""
    if not cfg.launcher.elastic:
        return None
    par, train = cfg.parallel, cfg.train
    fixed = par.tp * par.pp * par.cp  # kept; dp takes what is left
    if world % fixed:
        raise ElasticError(
            f"launcher.elastic: this run got {world} rank(s), which parallel.tp*parallel.pp*parallel.cp = "
            f"{par.tp}*{par.pp}*{par.cp} = {fixed} does not divide, so no dp fits; fix: start a multiple of {fixed} "
            "ranks (launcher.nproc, Slurm tasks), or change parallel.tp/pp/cp (the checkpoint reshards to them too)")
    dp = world // fixed
    was = newest_layout(os.path.join(run_dir, "checkpoints"))
    par.dp = dp
    ep_note = _replan_ep(par, dp)
    if was is None or was[1].get("dp") == dp:
        if ep_note:
            log.warning("megaft: elastic restart: %s", ep_note)
            print(f"megaft: elastic restart: {ep_note}", flush=True)
        return ep_note
    step, layout = was
    old_acc = train.global_batch_size // max(train.micro_batch_size * layout["dp"], 1)
    before = read_run_config(run_dir)  # the attempt that ran before this one (config.yaml)
    if before is not None and before.config.parallel.dp == layout["dp"]:
        old_acc = before.accumulation_steps  # what it ran, even with another micro-batch size
    new_acc = train.global_batch_size // max(train.micro_batch_size * dp, 1)
    msg = (f"megaft: elastic restart: checkpoint step {step} was written by {layout['world_size']} rank(s) "
           f"(tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}); this run has {world}: tp={par.tp} pp={par.pp} "
           f"dp={dp}, gradient accumulation {old_acc} -> {new_acc} micro-batches per rank, global batch "
           f"{train.global_batch_size} kept; the checkpoint is resharded" + (f"; {ep_note}" if ep_note else ""))
    log.warning(msg)
    print(msg, flush=True)
    return msg


def _replan_ep(par, dp: int) -> Optional[str]:
    """Expert parallelism after dp changed: ep must still divide dp*cp; the largest divisor of
    the old ep that does (it still divides the experts) keeps the most of the split."""
    ep = math.gcd(par.ep, dp * par.cp)
    if ep == par.ep:
        return None
    note = (f"parallel.ep {par.ep} -> {ep} (ep must divide dp*cp = {dp * par.cp}; the experts' checkpoint slices "
            "are resharded)")
    par.ep = ep
    return note


def requeue_after_loss(max_requeue: int, run_dir: str, world: int, since: float) -> None:
    """Rank 0 of an elastic Slurm job whose collective failed on lost ranks: requeue the job and
    ask for the nodes that remain (megaft.launch.preempt), where dp follows the smaller world and
    the newest checkpoint is resharded. The requeue SIGTERMs this task: ignored, so the node
    request can still be updated after it (the caller re-raises and exits right after)."""
    with contextlib.suppress(ValueError):  # not the main thread: no handlers to change
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    msg = requeue(max_requeue, why="a rank was lost (see the error below)")
    if "requeued Slurm job" in msg:
        shrink_requeued(health.silent_hosts(run_dir, world, since=since))


def record_restarts(run_dir: str, restarts: int) -> None:
    """Add `restarts` to the run's summary.json, when the run finished (wrote one)."""
    summary = RunSummary.read(run_dir)
    if summary is None:
        return
    summary.restarts = restarts
    summary.write(run_dir)
