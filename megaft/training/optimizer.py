"""The optimizer part: one surface over the flat buffers, the (ZeRO-sharded) AdamW, the
bucketed dp reduction and the fp16 loss scaler, that owns the order of an optimizer step.

`OptimParts.step(lr)` is the sequence every rank runs after the last backward:

    finish the dp reduction -> sum sequence-parallel grads over tp -> unscale (fp16)
    -> global grad norm -> clip -> AdamW step (skipped on every rank after an fp16
    overflow on any) -> update the loss scale -> zero the grads

The gradient is read only after every bucket was reduced, and the tp sum commutes with
the dp sum, so the order above is the one the exactness tests pin down.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch

from megaft import checkpoint
from megaft.checkpoint.reshard import param_index
from megaft.optim.adamw import AdamW
from megaft.optim.clip import clip_grad_norm_
from megaft.optim.muon import MuonAdamW, flat_split, muon_split, split_record, split_sizes
from megaft.optim.muon_zero import ShardedMuon
from megaft.optim.scaler import LossScaler
from megaft.optim.zero import ShardedAdamW, build_optimizer
from megaft.parallel.data import FlatParams, GradReducer
from megaft.parallel.grid import ParallelGrid
from megaft.training.phases import PhaseTimer
from megaft.training.protocols import RunParts, StepStats


@dataclass
class OptimParts:
    """Flat parameter/gradient buffers, the (ZeRO-sharded) optimizer, the bucketed dp
    reduction and the fp16 loss scaler (None otherwise; the optimizer saves it), with the
    model, grid and phase timer the step needs."""

    flat: FlatParams
    optimizer: AdamW | ShardedAdamW
    reducer: GradReducer
    scaler: Optional[LossScaler]
    model: torch.nn.Module
    grid: ParallelGrid
    phases: PhaseTimer
    clip_grad: float = 1.0  # optim.clip_grad; <= 0: no clipping

    def loss_divisor(self, n_targets: int) -> float:
        """What each micro-batch's loss sum is divided by before backward: fp16 backpropagates
        loss * scale, and dividing by n_targets / scale keeps one code path."""
        return n_targets / self.scaler.scale if self.scaler else n_targets

    def arm_reduction(self) -> None:
        """Let the dp buckets reduce during the coming backward (the step's last micro-batch)."""
        self.reducer.arm()

    def step(self, lr: float) -> StepStats:
        """The optimizer step of the module docstring, at learning rate `lr`."""
        grid, phases, opt = self.grid, self.phases, self.optimizer
        with phases.phase("comm"):
            self.reducer.finish()  # every bucket reduced over dp before any gradient is read
        phases.begin("optimizer")  # clip + step (+ the grad-norm all-reduce)
        opt.sync_sequence_parallel(grid.tp_group)  # a tp sum: commutes with the dp sum
        finite = self.scaler.unscale_(opt.grads) if self.scaler else True
        norm = opt.grad_norm(grid.tp_group, grid.pp_group)
        if finite:  # fp16 overflow on any rank: every rank skips the update
            clip_grad_norm_(opt.grads, norm, self.clip_grad)
            opt.step(lr)
        if self.scaler:
            self.scaler.update(finite)
        opt.zero_grad()
        phases.end("optimizer")
        if self.scaler:
            return StepStats(lr, norm, finite, loss_scale=self.scaler.scale, skipped_steps=self.scaler.skipped)
        return StepStats(lr, norm, finite)

    def whole_params(self):
        """A context with every parameter whole on every rank (ZeRO-3 gathers; else a no-op)."""
        return self.optimizer.whole_params()

    def take_sent_bytes(self) -> int:
        """Bytes the dp reduction handed to collectives since the last call."""
        return self.reducer.take_sent_bytes()

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes held for params, grads and optimizer state (megaft.optim.zero)."""
        return self.optimizer.memory_bytes()

    def capture(self, step: int) -> dict[str, Any]:
        """This rank's checkpoint shard after `step` steps (+ PowerSGD state, and the names,
        offsets and splits that let a load reshard it: megaft.checkpoint.reshard)."""
        state = checkpoint.capture(self.flat, self.optimizer, self.grid, step, reducer=self.reducer)
        state["index"] = param_index(self.model, self.flat)
        return state

    def restore(self, checkpoint_dir: str, meta: dict[str, Any]) -> Optional[int]:
        """Load the newest complete checkpoint under checkpoint_dir (resharded to this layout);
        its step, or None when there is none. `meta`: what this run's checkpoints record
        (its model, a LoRA run's base): another model or base is an error."""
        return checkpoint.load_latest(checkpoint_dir, self.flat, self.optimizer, self.grid, model=self.model,
                                      reducer=self.reducer,  # + PowerSGD state (megaft.checkpoint.state)
                                      model_config=meta["model"], lora=meta.get("lora", {}))


def build_optim(parts: RunParts) -> OptimParts:
    """The optimizer of parts.model: ZeRO stage, buckets, compression and offload from
    cfg.parallel, AdamW from cfg.optim, a loss scaler under fp16."""
    cfg, grid, model = parts.cfg, parts.grid, parts.model
    scaler, classes, flat_kw = None, None, {}
    if cfg.optim.name == "muon":  # the split is fixed before FlatParams moves the params into buffers
        split = muon_split(model)
        classes = (partial(MuonAdamW, split=split, tp_group=grid.tp_group),
                   partial(ShardedMuon, split=split, tp_group=grid.tp_group))
        flat_kw = flat_split(split)  # the Muon matrices in buffers of their own: one state buffer
    if cfg.precision == "fp16":
        scaler = LossScaler(init_scale=cfg.optim.loss_scale, growth_interval=cfg.optim.loss_scale_window)
    flat, optimizer, reducer = build_optimizer(
        model, cfg.optim, zero=cfg.parallel.zero, bucket_mb=cfg.parallel.bucket_mb, grid=grid,
        norm_params=model.norm_params() if grid.pp_size > 1 else None, compression=cfg.parallel,
        offload=cfg.parallel.offload, scaler=scaler, classes=classes, **flat_kw)
    if classes is not None:  # summary.json's `optimizer`, over every pp stage; printed once
        optimizer.record = split_record(split_sizes(split), grid.pp_group, log=grid.rank == 0)
    return OptimParts(flat, optimizer, reducer, scaler, model, grid, parts.phases, clip_grad=cfg.optim.clip_grad)
