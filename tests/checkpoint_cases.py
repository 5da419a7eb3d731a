"""Configs and rank functions for the checkpoint/resume tests (see tests/test_checkpoint.py)."""
from __future__ import annotations

import os
import shutil
from typing import Optional

from train_cases import read_metrics, small_config

from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer


def assert_same_losses(got_dir: str, want_dir: str) -> None:
    """Bitwise: same rank layout, same ops in the same order, so every float must be equal."""
    got, got_eval = read_metrics(got_dir)
    want, want_eval = read_metrics(want_dir)
    assert len(got) == len(want) == 20
    assert got == want  # == on floats on purpose: resume must be exact on CPU
    assert [(e["step"], e["eval_loss"]) for e in got_eval] == [(e["step"], e["eval_loss"]) for e in want_eval]


def train(run_dir: str, *, save_every: int = 0, keep_last: int = 2, stop_after: Optional[int] = None,
          tp: int = 1, grid: Optional[ParallelGrid] = None, async_save: bool = False) -> None:
    """small_config (20 steps) in run_dir, resuming from its checkpoints if any."""
    os.makedirs(run_dir, exist_ok=True)
    cfg = small_config()
    cfg.train.save_every, cfg.train.keep_last, cfg.train.async_save = save_every, keep_last, async_save
    cfg.parallel.tp = tp
    Trainer(cfg, grid or ParallelGrid.single(), run_dir).fit(stop_after=stop_after)


def tp2_straight_and_resumed(rank: int, world: int, root: str) -> None:
    """At tp=2: 20 steps straight; 10 steps, stop, resume in a fresh Trainer, 10 more (sync and async saves)."""
    grid = ParallelGrid.build(tp=2, dp=1, pp=1, device="cpu")
    train(os.path.join(root, "straight"), tp=2, grid=grid)
    resumed = os.path.join(root, "resumed")
    train(resumed, save_every=10, stop_after=10, tp=2, grid=grid)
    train(resumed, save_every=10, tp=2, grid=grid)
    resumed_async = os.path.join(root, "resumed_async")  # the same with train.async_save=true
    train(resumed_async, save_every=10, stop_after=10, tp=2, grid=grid, async_save=True)
    train(resumed_async, save_every=10, tp=2, grid=grid, async_save=True)


def resume_resharded(rank: int, world: int, root: str) -> None:
    """Resume the copies of a tp=2 run's step-10 checkpoint under root at pp=2, at dp=2 and at
    dp=2 with ZeRO-1 (its moments cut into this layout's chunks)."""
    for name, tp, pp, dp, zero in (("pp2", 1, 2, 1, 0), ("dp2", 1, 1, 2, 0), ("zero1", 1, 1, 2, 1)):
        cfg = small_config(micro=8 // dp)
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = tp, pp, dp, zero
        cfg.train.save_every = 10
        grid = ParallelGrid.build(tp=tp, dp=dp, pp=pp, device="cpu")
        Trainer(cfg, grid, os.path.join(root, name)).fit()


# Resharding with ZeRO and across pp (world size 2): runs saved at step 10 under these
# layouts, (name -> tp, pp, dp, zero, bucket_mb); bucket_mb=0.01 cuts the tiny model into
# many buckets, so a rank's ZeRO chunks are many scattered ranges of each buffer.
SAVED = {"z2": (1, 1, 2, 2, 0.01), "z1": (1, 1, 2, 1, 0.01), "pp2": (1, 2, 1, 0, 25.0)}
# resumed copy -> (saved run, tp, pp, dp, zero, bucket_mb); the first ones run on 2 ranks, the
# 1-rank ones in the test's own process (RESUMED_SINGLE).
RESUMED_WORLD2 = {"z1_to_z3": ("z1", 1, 1, 2, 3, 25.0), "z2_to_tp2": ("z2", 2, 1, 1, 0, 25.0),
                  "z2_to_z1_buckets": ("z2", 1, 1, 2, 1, 0.02), "z2_same": ("z2", *SAVED["z2"])}
RESUMED_SINGLE = {"z2_to_single": ("z2", 1, 1, 1, 0, 25.0), "pp2_to_single": ("pp2", 1, 1, 1, 0, 25.0)}


def layout_config(tp: int, pp: int, dp: int, zero: int, bucket_mb: float):
    cfg = small_config(micro=8 // dp)
    par = cfg.parallel
    par.tp, par.pp, par.dp, par.zero, par.bucket_mb = tp, pp, dp, zero, bucket_mb
    cfg.train.save_every = 10
    return cfg


def run_layout(run_dir: str, tp: int, pp: int, dp: int, zero: int, bucket_mb: float,
               stop_after: Optional[int] = None) -> None:
    os.makedirs(run_dir, exist_ok=True)
    grid = ParallelGrid.single() if tp * pp * dp == 1 else ParallelGrid.build(tp=tp, dp=dp, pp=pp, device="cpu")
    Trainer(layout_config(tp, pp, dp, zero, bucket_mb), grid, run_dir).fit(stop_after=stop_after)


def save_and_reshard_zero(rank: int, world: int, root: str) -> None:
    """Every SAVED run stops after 10 steps; rank 0 copies each resumed run's source, and
    the RESUMED_WORLD2 copies continue to step 20 in their own layouts."""
    import torch.distributed as dist

    run_layout(os.path.join(root, "z2_straight"), *SAVED["z2"])  # same-layout resume must equal it bitwise
    for name, spec in SAVED.items():
        run_layout(os.path.join(root, name), *spec, stop_after=10)
    if rank == 0:
        for name, (src, *_) in {**RESUMED_WORLD2, **RESUMED_SINGLE}.items():
            shutil.copytree(os.path.join(root, src), os.path.join(root, name))  # stopped at step 10
    dist.barrier()
    for name, (_, *spec) in RESUMED_WORLD2.items():
        run_layout(os.path.join(root, name), *spec)
