"""train.epochs -> train.max_steps, resolved once before any rank starts (megaft.train.run).

An epoch is one pass over what train.global_batch_size counts, which the objective's data part
says (its `unit` and `units_in`, megaft.training.objectives): packed sequences for sft (under
packing=docs|none each epoch's own packing plan, as a stream its tokens / data.seq_len), pairs
for the preference objectives (the data.sources mixture's draw), completions for grpo (the
logged groups times rl.num_generations). The data part is built here once, the way every rank
builds it, so the count is the trainer's. The run takes ceil(units / global batch) steps: no
batch is partial, so the last one may start the next epoch, and fractional epochs (1.5) end
on the step that reaches them.

A restarted attempt (resume, Slurm requeue, elastic restart on another dp: the global batch
is kept) takes the steps from the run directory's config.yaml (`derived.epochs`, written by
rank 0 at every attempt's start) when that run had the same train.epochs and global batch, so
its epoch boundaries and LR schedule stay where the first attempt put them, even if the files
changed since; train.resume=false counts afresh.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from megaft.config import Config
from megaft.training.run_config import stored_epoch_steps


@dataclass(frozen=True)
class EpochSteps:
    """What train.epochs resolved to."""

    epochs: float
    max_steps: int
    units: Optional[Fraction] = None  # the units of those epochs; None: the steps came from config.yaml
    unit: str = ""  # sequences | pairs | completions

    def describe(self, global_batch_size: int) -> str:
        if self.units is None:
            return (f"train.epochs={self.epochs}: {self.max_steps} steps, as the run directory's config.yaml "
                    "resolved them (the same epoch boundaries as its earlier attempts)")
        return (f"train.epochs={self.epochs}: {float(self.units):g} {self.unit} at train.global_batch_size="
                f"{global_batch_size} -> {self.max_steps} steps")


def steps_for(units: Fraction, global_batch_size: int) -> int:
    """Steps to cover `units` with whole global batches (at least one)."""
    return max(1, math.ceil(units / global_batch_size))


def count_epoch_steps(cfg: Config) -> EpochSteps:
    """train.epochs counted on the data: the objective's data part, built as a rank builds it."""
    # here, not at the top: a run sized in steps starts its ranks without torch in the launcher
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.objectives import objective_of
    from megaft.training.protocols import RunParts

    t = cfg.train
    with warnings.catch_warnings():  # the ranks warn about the data (long documents, ...) themselves
        warnings.simplefilter("ignore")
        data = objective_of(t.objective).build_data(RunParts(cfg, ParallelGrid.single()))
    # the decimal the user wrote (1.1 is not 11/10 in binary): no step appears or vanishes by rounding
    units = data.units_in(Fraction(repr(t.epochs)))
    return EpochSteps(t.epochs, steps_for(units, t.global_batch_size), units, data.unit)


def resolve_epochs(cfg: Config, run_dir: str) -> Optional[EpochSteps]:
    """Set train.max_steps from train.epochs (in place; None when the run is sized in steps):
    the steps config.yaml of `run_dir` recorded when the run restarts, else counted on the data."""
    t = cfg.train
    if t.epochs is None:
        return None
    stored = stored_epoch_steps(run_dir, t.epochs, t.global_batch_size) if t.resume else None
    plan = EpochSteps(t.epochs, stored) if stored is not None else count_epoch_steps(cfg)
    t.max_steps = plan.max_steps
    return plan
