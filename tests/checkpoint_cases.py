"""Configs and rank functions for the checkpoint/resume tests (see tests/test_checkpoint.py)."""
from __future__ import annotations

import os
from typing import Optional

from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from train_cases import small_config


def train(run_dir: str, *, save_every: int = 0, keep_last: int = 2, stop_after: Optional[int] = None,
          tp: int = 1, grid: Optional[ParallelGrid] = None) -> None:
    """small_config (20 steps) in run_dir, resuming from its checkpoints if any."""
    os.makedirs(run_dir, exist_ok=True)
    cfg = small_config()
    cfg.train.save_every, cfg.train.keep_last = save_every, keep_last
    cfg.parallel.tp = tp
    Trainer(cfg, grid or ParallelGrid.single(), run_dir).fit(stop_after=stop_after)


def tp2_straight_and_resumed(rank: int, world: int, root: str) -> None:
    """At tp=2: 20 steps straight; 10 steps, stop, resume in a fresh Trainer, 10 more."""
    grid = ParallelGrid.build(tp=2, dp=1, pp=1, device="cpu")
    train(os.path.join(root, "straight"), tp=2, grid=grid)
    resumed = os.path.join(root, "resumed")
    train(resumed, save_every=10, stop_after=10, tp=2, grid=grid)
    train(resumed, save_every=10, tp=2, grid=grid)
