"""train.objective=distill: logit distillation from a frozen teacher (distill.teacher), TRL 1.16's
generalized JSD (megaft.distill.losses) on the target tokens of any SFT data (text, chat, packed: the
data part is sft's), mixed with the token cross-entropy at distill.alpha.

The teacher is built at the run's tp/pp layout from its Hugging Face checkpoint (as GRPO's and the
preference objectives' reference model: megaft.training.objectives.grpo.reference_model), without
adapters, whole under ZeRO (it is only read), in eval mode with no grads; it scores each micro-batch
before the student's forward (under pp: its own pass of the schedule's forwards, the last stage
keeping each micro-batch's logits slice until the schedule's head reads it).

A micro-batch's loss is sum over its target tokens of (1 - alpha) D + alpha CE, D the divergence
of both models' vocabulary slices (never gathered), CE megaft's vocab-parallel cross-entropy; the
trainer divides by the global batch's target tokens, so the step's loss is TRL's
generalized_jsd_loss with num_items_in_batch (the gradient-accumulation-correct reduction) at every
split over micro-batches, dp and cp.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch

from megaft.distill.losses import token_divergence
from megaft.distill.policy import DATA
from megaft.models.hf.config import hf_model_config
from megaft.pipeline.runtime import PipelineRuntime
from megaft.pref.logps import token_logps
from megaft.training.model import build_model
from megaft.training.objectives.distill_policy import PolicyData, completion_generator, source_metrics, with_generation
from megaft.training.objectives.distill_topk import TopKDistillStep, with_rows
from megaft.training.objectives.sft import build_data as sft_data
from megaft.training.protocols import RunParts, StepBatch, StepPart
from megaft.training.step import PipelineStep, PlainStep, precision_autocast

__all__ = ["build_data", "build_step", "teacher_model"]


def teacher_model(parts: RunParts) -> torch.nn.Module:
    """distill.teacher at this rank's layout, without adapters, frozen in eval mode."""
    cfg = parts.cfg
    teacher = copy.deepcopy(cfg)
    teacher.model = hf_model_config(cfg.distill.teacher, base=cfg.model)  # validated: the student's vocabulary
    teacher.lora.rank = 0
    return build_model(dataclasses.replace(parts, cfg=teacher)).eval().requires_grad_(False)


class DistillLoss:
    """A micro-batch's summed loss from the student's and the teacher's logits slices."""

    def __init__(self, parts: RunParts, group, vocab_size: int):
        d = parts.cfg.distill
        self.beta, self.temperature, self.alpha, self.chunk = d.effective_beta, d.temperature, d.alpha, d.chunk_tokens
        self.group, self.vocab_size = group, vocab_size

    def __call__(self, student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = labels.shape[1]
        student, teacher = student[:, :n], teacher[:, :n]
        loss = token_divergence(student, teacher, labels, beta=self.beta, temperature=self.temperature,
                                group=self.group, vocab_size=self.vocab_size, chunk=self.chunk).sum()
        if self.alpha == 0:
            return loss
        ce = -token_logps(student, labels, group=self.group, vocab_size=self.vocab_size).sum()
        return (1 - self.alpha) * loss + self.alpha * ce


class DistillStep(PlainStep):
    """Forward and backward of a step's micro-batches against the teacher (pp = 1)."""

    def __init__(self, parts: RunParts):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, parts.optim, grid, parts.phases, precision_autocast(cfg.precision, grid.device))
        self.teacher = teacher_model(parts)
        self.loss = DistillLoss(parts, self.model.group, cfg.model.vocab_size)
        self.distill, self.source = cfg.distill, None

    def step_metrics(self) -> dict[str, float]:
        return {**super().step_metrics(), **source_metrics(self.distill, self.source)}

    def forward_backward(self, batch: StepBatch, divisor: float) -> torch.Tensor:
        """Backpropagate sum(loss) / divisor over the micro-batches; the loss sum (fp64)."""
        self.source = getattr(batch, "source", DATA)
        if self.model.cfg.n_experts > 0:
            raise NotImplementedError("train.objective=distill of a mixture of experts (validation refuses it)")

        def loss_of(i: int, inputs: torch.Tensor, labels: torch.Tensor, docs) -> torch.Tensor:
            with torch.no_grad(), self.autocast():
                teacher = self.teacher(inputs, docs)
            with self.autocast():
                return self.loss(self.model(inputs, docs), teacher, labels)
        return self.backward_each(batch, divisor, loss_of)


class PipelineDistillStep(PipelineStep):
    """Distillation through the rank's pipeline schedule (pp > 1): the teacher's forwards first, the
    last stage keeping each micro-batch's logits slice; the schedule's head turns the student's
    logits into the micro-batch's loss."""

    def __init__(self, parts: RunParts):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, grid, cfg, parts.phases, precision_autocast(cfg.precision, grid.device))
        self.teacher = PipelineRuntime(teacher_model(parts), grid, cfg.parallel.schedule, self.runtime.m,
                                       cfg.parallel.vpp)
        self.loss = DistillLoss(parts, grid.tp_group, cfg.model.vocab_size)
        self.distill, self.source = cfg.distill, None

    def step_metrics(self) -> dict[str, float]:
        return {**super().step_metrics(), **source_metrics(self.distill, self.source)}

    def _teacher_logits(self, batch: StepBatch) -> list[Optional[torch.Tensor]]:
        device = self.grid.device
        with torch.no_grad():
            return [self.teacher.forward_logits(inputs.to(device), self.autocast, batch.docs[i] if batch.docs else None)
                    for i, inputs in enumerate(batch.inputs)]

    def forward_backward(self, batch: StepBatch, divisor: float) -> torch.Tensor:
        if self.model.cfg.n_experts > 0:
            raise NotImplementedError("train.objective=distill of a mixture of experts (validation refuses it)")
        device = self.grid.device
        self.source = getattr(batch, "source", DATA)
        with self.phases.phase("forward"):
            teacher = self._teacher_logits(batch)

        def head(i: int, logits: torch.Tensor) -> torch.Tensor:
            return self.loss(logits, teacher[i], batch.labels[i].to(device))
        return self.run_schedule(batch, divisor, head=head)


def build_data(parts: RunParts):
    """sft's data part; with distill.top_k each micro-batch also carries its target tokens' rows of
    the stored teacher (megaft.training.objectives.distill_topk); with distill.lmbda or seq_kd some
    steps' completions are generated (megaft.training.objectives.distill_policy)."""
    data = sft_data(parts)
    if parts.cfg.distill.top_k is not None:
        return with_rows(data, parts)
    return with_generation(data, parts) if parts.cfg.distill.generates else data


def build_step(parts: RunParts) -> StepPart:
    if parts.cfg.distill.top_k is not None:
        return TopKDistillStep(parts, teacher_model)
    step = PipelineDistillStep(parts) if parts.grid.pp_size > 1 else DistillStep(parts)
    if isinstance(parts.data, PolicyData):  # distill.lmbda / seq_kd: the student or the teacher generates
        parts.data.generate = completion_generator(parts, step.generator, step.teacher, step.autocast)
    return step
