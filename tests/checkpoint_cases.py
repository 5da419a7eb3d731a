"""Configs and rank functions for the checkpoint/resume tests (see tests/test_checkpoint.py)."""
from __future__ import annotations

import os
from typing import Optional

from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from train_cases import read_metrics, small_config


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
    """Resume the copies of a tp=2 run's step-10 checkpoint under root at pp=2 and at dp=2;
    at dp=2 with ZeRO-1 resharding is refused with a clear error."""
    import pytest

    from megaft.checkpoint import LayoutMismatchError

    for name, tp, pp, dp, zero in (("pp2", 1, 2, 1, 0), ("dp2", 1, 1, 2, 0), ("zero1", 1, 1, 2, 1)):
        cfg = small_config(micro=8 // dp)
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = tp, pp, dp, zero
        cfg.train.save_every = 10
        grid = ParallelGrid.build(tp=tp, dp=dp, pp=pp, device="cpu")
        if zero:
            with pytest.raises(LayoutMismatchError, match=r"cannot reshard: resharding needs parallel.zero=0"):
                Trainer(cfg, grid, os.path.join(root, name)).fit()
        else:
            Trainer(cfg, grid, os.path.join(root, name)).fit()
