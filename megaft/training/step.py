"""The step part: forward and backward of one step's micro-batches, picked once per run.

`PlainStep` runs each micro-batch through the whole model (pp = 1); `PipelineStep` runs the
rank's pipeline schedule (pp > 1). Both evaluate through the same path and own the run's
autocast (train.precision), so the trainer never sees a model's or a schedule's details.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megaft.config import Config
from megaft.config.train import accumulation_steps
from megaft.models.decoder import Decoder
from megaft.models.moe.balance import update_correction_biases
from megaft.models.moe.global_router import global_counts
from megaft.models.moe.metrics import router_weight
from megaft.models.moe.stats import StepRouterStats
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid
from megaft.pipeline.runtime import PipelineRuntime
from megaft.pipeline.stage import StageModel, sync_tied_grads
from megaft.training.evaluate import eval_loss, pipeline_eval_loss
from megaft.training.phases import PhaseTimer
from megaft.training.protocols import Autocast, Batches, OptimPart, RunParts, StepBatch


def precision_autocast(precision: str, device: torch.device) -> Autocast:
    """A function returning a fresh autocast context: bf16/fp16 compute, fp32 a no-op."""
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return lambda: torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext


class _Step:
    """What both steps share: the loss sum over the replicas, and the autocast."""

    reference_s: Optional[float] = None  # seconds scoring a preference reference before step 1 (pref_step)

    def __init__(self, grid: ParallelGrid, phases: PhaseTimer, autocast: Autocast):
        self.grid, self.phases, self.autocast = grid, phases, autocast

    def finish_step(self) -> None:
        """After the optimizer step and `step_metrics`: DeepSeek-V3's routing correction biases move by
        moe.bias_update_rate from the step's expert loads over the global batch (the same on every
        rank; a pipeline stage moves its own layers'), megaft.models.moe.balance."""
        rate = getattr(self.model.routing, "bias_update_rate", 0.0)
        counts = self.stats.step_counts if rate else None
        if counts:
            update_correction_biases(self.model, counts, rate)

    @property
    def stats(self) -> StepRouterStats:
        return self.router_stats

    def total_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The global batch's loss sum on every rank, from this rank's (in place)."""
        with self.phases.phase("comm"):
            all_reduce(loss_sum, self.grid.replica_group)  # dp×cp: cp ranks hold parts of each row
        return loss_sum


class PlainStep(_Step):
    """Forward and backward of each micro-batch through the whole model (pp = 1); the dp
    buckets reduce during the last backward."""

    def __init__(self, model: Decoder, optim: OptimPart, grid: ParallelGrid, phases: PhaseTimer, autocast: Autocast):
        super().__init__(grid, phases, autocast)
        self.model, self.optim = model, optim
        self.router_stats = StepRouterStats.of(model)

    def backward_each(self, batch: StepBatch, divisor: float, loss_of) -> torch.Tensor:
        """Backpropagate `loss_of(i, inputs, labels, docs)` / divisor of each micro-batch i (computed in
        the forward phase, on the device; the dp buckets reduce during the last backward); returns
        their sum (fp64). The loop of the objectives whose loss is one tensor (distillation's)."""
        device, phase = self.grid.device, self.phases.phase
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, (mb_in, mb_lab) in enumerate(zip(batch.inputs, batch.labels)):
            if i == len(batch.inputs) - 1:
                self.optim.arm_reduction()  # buckets reduce during the last backward only
            with phase("forward"):
                loss = loss_of(i, mb_in.to(device), mb_lab.to(device), batch.docs[i] if batch.docs else None)
            with phase("backward"):
                (loss / divisor).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    def forward_backward(self, batch: StepBatch, divisor: float) -> torch.Tensor:
        """Backpropagate sum(loss) / divisor over the micro-batches (plus, for a mixture of
        experts, the router terms averaged over the global batch's micro-batches,
        megaft.models.moe.metrics); returns the loss sum (fp64)."""
        device, phase = self.grid.device, self.phases.phase
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.router_stats = StepRouterStats.of(self.model)
        weight = router_weight(batch.n_targets, len(batch.inputs), self.grid.dp_size, self.model.routing)
        if self.model.routing.aux_scope == "global_batch" and self.model.cfg.n_experts > 0:
            with phase("forward"):
                self.model.global_counts = global_counts(self.model.router_counts, batch.inputs, batch.docs,
                                                         self.grid, self.model.cfg.n_experts, self.autocast)
        for i, (mb_in, mb_lab) in enumerate(zip(batch.inputs, batch.labels)):
            if i == len(batch.inputs) - 1:
                self.optim.arm_reduction()  # buckets reduce during the last backward only
            docs = batch.docs[i] if batch.docs else None
            with phase("forward"), self.autocast():
                loss = self.model.loss_sum(mb_in.to(device), mb_lab.to(device), docs)
                router = self.model.router_losses()
            objective = loss
            if router is not None:
                objective = loss + router.local * weight
                self.router_stats.add(router)
            with phase("backward"):
                (objective / divisor).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    def step_metrics(self) -> dict[str, float]:
        """aux_loss, z_loss and the expert loads of the last step (collective over dp); {} when dense."""
        return self.router_stats.record(self.grid.dp_group)

    def eval_loss(self, batches: Batches) -> Optional[float]:
        return eval_loss(self.model, batches, self.grid, self.autocast)

    @property
    def generator(self):
        """What greedy generation runs through (megaft.training.evaluate.eval_accuracy)."""
        return self.model

    @property
    def current_action(self):
        """The pipeline action in hand, for hang reports: none without a pipeline."""
        return None


class PipelineStep(_Step):
    """The rank's pipeline schedule over the micro-batches (pp > 1); the dp reduction runs
    after it (the reducer is not armed), and the tied embedding copies sum their grads."""

    def __init__(self, model: StageModel, grid: ParallelGrid, cfg: Config, phases: PhaseTimer, autocast: Autocast):
        super().__init__(grid, phases, autocast)
        self.model = model
        self.runtime = PipelineRuntime(model, grid, cfg.parallel.schedule,
                                       accumulation_steps(cfg.train, grid.dp_size), cfg.parallel.vpp,
                                       wrap_compute=phases.timed_handler)

    def forward_backward(self, batch: StepBatch, divisor: float) -> torch.Tensor:
        weight = router_weight(batch.n_targets, len(batch.inputs), self.grid.dp_size, self.model.routing)
        if self.model.routing.aux_scope == "global_batch" and self.model.cfg.n_experts > 0:
            with self.phases.phase("forward"):
                self.model.global_counts = global_counts(
                    lambda ids, docs: self.runtime.router_counts(ids, self.autocast, docs), batch.inputs,
                    batch.docs, self.grid, self.model.cfg.n_experts, self.autocast)
        return self.run_schedule(batch, divisor, router_weight=weight)

    def run_schedule(self, batch: StepBatch, divisor: float, **kwargs) -> torch.Tensor:
        """The schedule over the batch's micro-batches (`kwargs`: PipelineRuntime.train_step's), the
        tied embedding's grads summed, the last stage's loss sum on every pp rank."""
        loss_sum = self.runtime.train_step(list(batch.inputs), list(batch.labels), divisor, self.autocast,
                                           batch.docs, **kwargs)
        self.phases.add("comm", self.runtime.wait_s)
        with self.phases.phase("comm"):
            sync_tied_grads(self.model, self.grid.embedding_group)
            all_reduce(loss_sum, self.grid.pp_group)  # the last stage's loss, on every pp rank
        return loss_sum

    def eval_loss(self, batches: Batches) -> Optional[float]:
        return pipeline_eval_loss(self.runtime, batches, self.grid, self.autocast)

    @property
    def generator(self):
        return self.runtime  # greedy generation through the stages

    @property
    def current_action(self):
        return self.runtime.current_action

    @property
    def stats(self) -> StepRouterStats:
        return self.runtime.router_stats

    def step_metrics(self) -> dict[str, float]:
        """As PlainStep's: each stage's counts and the last stage's values, summed over pp."""
        return self.runtime.router_stats.record(self.grid.dp_group, self.grid.pp_group)


def build_step(parts: RunParts) -> PlainStep | PipelineStep:
    """sft's step: the pipeline step when pp > 1, else the plain one (the preference steps
    extend them: megaft.training.objectives.preference)."""
    cfg, grid = parts.cfg, parts.grid
    autocast = precision_autocast(cfg.precision, grid.device)
    if grid.pp_size > 1:
        return PipelineStep(parts.model, grid, cfg, parts.phases, autocast)
    return PlainStep(parts.model, parts.optim, grid, parts.phases, autocast)
