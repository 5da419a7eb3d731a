"""The records part: what a run writes and watches.

config.yaml (the config that ran), metrics.jsonl (and TensorBoard), checkpoints (the
writer, whose manifests carry the model record resume checks, and a LoRA run's base),
summary.json, the one per-step agreement on where to stop, the non-finite-step guard and
the per-rank step times. Rank 0 writes the run directory's files; every rank takes part
in the collectives (the stop agreement, the straggler gather, checkpoint shards).
"""
from __future__ import annotations

import os
from typing import Any

from megaft import checkpoint
from megaft.config import Config
from megaft.config.train import use_tensorboard
from megaft.distill.policy import METRICS as DISTILL_METRICS
from megaft.models.moe.metrics import ROUTER_KEYS
from megaft.parallel.grid import ParallelGrid
from megaft.peft.base import lora_record
from megaft.pref.losses import METRICS as PREF_METRICS
from megaft.pref.losses import ORPO_METRICS
from megaft.reward.losses import REWARD_METRICS
from megaft.rl.losses import METRICS as RL_METRICS
from megaft.training.guards import BadStepGuard, model_signature
from megaft.training.metrics import MetricsLog
from megaft.training.phases import PHASE_KEYS
from megaft.training.protocols import RunParts
from megaft.training.run_config import ran_config, write_run_config
from megaft.training.stop import StepBoundary
from megaft.training.stragglers import StragglerMonitor
from megaft.training.summary import RunSummary

# the step part's own metrics beside `loss` (MoE router terms, preference rewards, GRPO's; per MoE layer:
# moe/<layer>/...; per GRPO reward function: rewards/<name>/mean and std; a reward model's TRL metrics; who
# wrote an on-policy distillation step's completions)
STEP_KEYS = ROUTER_KEYS + PREF_METRICS + ORPO_METRICS + RL_METRICS + REWARD_METRICS + DISTILL_METRICS


class Records:
    """metrics.jsonl, the checkpoint writer, the stop agreement, the guard and the straggler
    monitor of one rank, with `save_every` / `save_final` deciding when a step boundary saves."""

    def __init__(self, metrics: MetricsLog, writer: checkpoint.CheckpointWriter, boundary: StepBoundary,
                 guard: BadStepGuard, stragglers: StragglerMonitor, *, grid: ParallelGrid, run_dir: str,
                 save_every: int = 0, save_final: bool = False):
        self.metrics, self.writer, self.boundary = metrics, writer, boundary
        self.guard, self.stragglers = guard, stragglers
        self.grid, self.run_dir, self.save_every, self.save_final = grid, run_dir, save_every, save_final
        self.is_writer = grid.rank == 0

    @property
    def checkpoint_dir(self) -> str:
        return self.writer.root

    @property
    def meta(self) -> dict[str, Any]:
        """What every checkpoint's manifest records beside the shards (the model; a LoRA run's base)."""
        return self.writer.meta

    def start(self, cfg: Config) -> None:
        """An attempt starts: rank 0 writes config.yaml, `cfg` on this grid (megaft.training.run_config),
        and under logger=wandb starts this attempt's W&B run with that config."""
        if self.is_writer:
            path = write_run_config(self.run_dir, ran_config(cfg, self.grid.world_size, self.grid.dp_size))
            if cfg.logger == "wandb" and self.metrics.tracker is None:
                from megaft.training.wandb_log import WandbLog, read_config_file

                self.metrics.tracker = WandbLog(cfg.wandb, self.run_dir, read_config_file(path))

    def log(self, **line: Any) -> None:
        """One metrics.jsonl line (rank 0)."""
        self.metrics.write(**line)

    def log_train(self, step: int, out: dict[str, Any], seconds: float, *, comm_bytes: int,
                  mfu: dict[str, float]) -> None:
        """Step `step`'s train line from the step's numbers `out` and its time `seconds`, with the
        straggler spread when it is gathered; raises after train.max_bad_steps non-finite steps."""
        # The rank's own work: the step minus the time it waited for the others (comm_s).
        spread = self.stragglers.observe(step, seconds - out.get("comm_s", 0.0))
        self.metrics.write(step=step, loss=out["loss"], lr=out["lr"], grad_norm=out["grad_norm"],
                           tokens_per_s=out["tokens"] / seconds, comm_bytes=comm_bytes,
                           **{k: out[k] for k in ("loss_scale", "skipped_steps") if k in out},
                           **{k: v for k, v in out.items() if k in STEP_KEYS or k.startswith(("moe/", "rewards/"))},
                           **mfu, **{k: out[k] for k in PHASE_KEYS if k in out}, **spread)
        self.guard.observe(step, out)

    def resumed_at(self, step: int) -> None:
        """Resumed from the checkpoint of `step`: drop the metrics lines written after it."""
        if self.is_writer:
            checkpoint.trim_metrics(self.metrics.path, step)

    def agree(self, flag: int) -> int:
        """The step boundary's ONE collective: every rank's stop request (max) and whether every
        async shard is written (then published); returns the agreed stop request."""
        stop, unfinished = self.boundary.agree(flag, self.writer.unfinished())
        if not unfinished:
            self.writer.all_written()
        return stop

    def should_save(self, done: int, end: int, *, force: bool) -> bool:
        """Whether to checkpoint after `done` steps: every train.save_every steps, at `end` (with
        train.save_final: a run keeps what it trained, megaft.config.keep) and when `force`d (a preemption: losing
        the work would be worse); never while the weights may be non-finite."""
        every = self.save_every
        final = self.save_final and done == end
        return bool(force or final or (every and done % every == 0)) and self.guard.may_save()

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.writer.save(step, state)

    def finish_saves(self) -> None:
        """Wait for and publish a pending async checkpoint."""
        self.writer.finish()

    def write_summary(self, summary: RunSummary) -> None:
        """summary.json of a finished run (rank 0)."""
        if self.is_writer:
            summary.write(self.run_dir)
            if self.metrics.tracker is not None:  # W&B's run summary: summary.json's numbers
                self.metrics.tracker.summary(summary.to_json())

    def close(self) -> None:
        self.metrics.close()


def build_records(parts: RunParts) -> Records:
    """The records of parts.run_dir: rank 0 writes the files, checkpoints go to checkpoints/."""
    cfg, grid, run_dir = parts.cfg, parts.grid, parts.run_dir
    is_writer = grid.rank == 0
    metrics = MetricsLog(run_dir, enabled=is_writer, tensorboard=is_writer and use_tensorboard(cfg.train.tensorboard))
    checkpoint_dir = os.path.join(run_dir, "checkpoints")
    writer = checkpoint.CheckpointWriter(checkpoint_dir, grid, keep_last=cfg.train.keep_last,
                                         async_save=cfg.train.async_save)
    writer.meta = {"model": model_signature(cfg.model)}
    if cfg.lora.rank > 0:  # adapter-only checkpoints name their base (megaft.peft.base): resume checks it
        writer.meta["lora"] = lora_record(cfg.lora, cfg.model.init_from, cfg.train.seed)
    return Records(metrics, writer, StepBoundary(grid.world_size, grid.device),
                   BadStepGuard(cfg.train.max_bad_steps, checkpoint_dir),
                   StragglerMonitor(grid, cfg.train.straggler_every, cfg.train.straggler_factor),
                   grid=grid, run_dir=run_dir, save_every=cfg.train.save_every,
                   save_final=cfg.train.save_final)
