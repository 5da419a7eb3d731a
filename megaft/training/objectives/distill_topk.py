"""train.objective=distill with distill.top_k: the teacher scored once before step 1 into its top-k
per target token (megaft.distill.stored), then freed; each micro-batch's loss is the divergence
over the k ids and the tail bucket (megaft.distill.topk) against the student's vocabulary slices,
mixed with the cross-entropy at distill.alpha as the online teacher's is. pp = 1 and cp = 1
(validation refuses the others: the rows are not yet passed through a schedule or the shards).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Optional

import torch

from megaft.distill.stored import CorpusRows, fingerprint_parts, load_topk, save_topk, score_corpus, topk_path
from megaft.distill.topk import TopK, topk_divergence
from megaft.pref.logps import token_logps
from megaft.training.objectives.sft import DataParts, micro_batches
from megaft.training.protocols import Builder, RunParts, StepBatch
from megaft.training.step import PlainStep, precision_autocast

__all__ = ["TopKDistillStep", "with_rows"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RowsBatch(StepBatch):
    """A StepBatch whose micro-batches also carry each position's stored row (-1: no target)."""

    rows: Optional[list[torch.Tensor]] = None


@dataclasses.dataclass
class RowsData(DataParts):
    """sft's data part, each batch with its target tokens' rows of the stored teacher."""

    corpus_rows: Optional[CorpusRows] = None

    def batch(self, step: int) -> RowsBatch:
        batch = super().batch(step)
        rows = self.corpus_rows.rows_of(self.stream.pieces(step, self.global_batch_size))
        micro = micro_batches(rows, rows, None, self.grid, self.micro_batch_size)[0]
        return RowsBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(StepBatch)}, rows=micro)


def with_rows(data: DataParts, parts: RunParts) -> RowsData:
    if not hasattr(data.stream, "pieces"):
        raise ValueError("distill.top_k needs data.packing=docs or none (validation refuses stream)")
    fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(DataParts)}
    return RowsData(**fields, corpus_rows=CorpusRows(data.stream.corpus, parts.cfg.data.seq_len))


def _score(parts: RunParts, rows: CorpusRows, autocast, teacher_model: Builder[torch.nn.Module]) -> TopK:
    """The stored top-k of this fingerprint, or the scoring of the corpus by the teacher `teacher_model`
    builds (kept with distill.scores). Every rank reads or scores; rank 0 writes."""
    cfg, grid = parts.cfg, parts.grid
    parts_fp = fingerprint_parts(cfg, rows, parts.data.tokenizer.to_str())
    path = topk_path(cfg.distill.scores, parts_fp) if cfg.distill.scores else None
    stored = load_topk(path, parts_fp) if path else None
    if stored is not None:
        log.info("the teacher's top-%d of %d target tokens read from %s", cfg.distill.top_k, len(rows), path)
        return stored
    top = _scored(teacher_model(parts), rows, autocast, cfg, grid)
    gc.collect()  # the teacher is not held while training (the memory check does not count it)
    if path and grid.rank == 0:
        save_topk(path, top, parts_fp)
    return top


def _scored(teacher: torch.nn.Module, rows: CorpusRows, autocast, cfg, grid) -> TopK:
    """The corpus through `teacher` (dropped with this frame)."""
    def logits(ids: torch.Tensor) -> torch.Tensor:
        with autocast():
            return teacher(ids, None)
    return score_corpus(logits, rows, cfg.distill.top_k, temperature=cfg.distill.temperature, grid=grid,
                        vocab_size=cfg.model.vocab_size)


class TopKDistillStep(PlainStep):
    """Forward and backward of a step's micro-batches against the stored top-k (pp = 1)."""

    def __init__(self, parts: RunParts, teacher_model: Builder[torch.nn.Module]):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, parts.optim, grid, parts.phases, precision_autocast(cfg.precision, grid.device))
        d = cfg.distill
        self.beta, self.temperature, self.alpha, self.chunk = d.effective_beta, d.temperature, d.alpha, d.chunk_tokens
        self.vocab_size = cfg.model.vocab_size
        self.top = _score(parts, parts.data.corpus_rows, self.autocast, teacher_model)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        logits = logits[:, :labels.shape[1]]
        if not torch.equal(rows >= 0, labels != -100):  # the plan and the store out of step: never pair wrongly
            raise RuntimeError("distill.top_k: the stored rows and the micro-batch's labels mark different target "
                               "tokens; fix: delete the stored top-k (distill.scores) and score again")
        picked = rows[rows >= 0]
        top = TopK(*(x[picked].to(logits.device) for x in self.top))
        group = self.model.group
        loss = topk_divergence(logits, top, labels, beta=self.beta, temperature=self.temperature, group=group,
                               vocab_size=self.vocab_size, chunk=self.chunk).sum()
        if self.alpha == 0:
            return loss
        ce = -token_logps(logits, labels, group=group, vocab_size=self.vocab_size).sum()
        return (1 - self.alpha) * loss + self.alpha * ce

    def forward_backward(self, batch: RowsBatch, divisor: float) -> torch.Tensor:
        """Backpropagate sum(loss) / divisor over the micro-batches; the loss sum (fp64)."""

        def loss_of(i: int, inputs: torch.Tensor, labels: torch.Tensor, docs) -> torch.Tensor:
            with self.autocast():
                return self._loss(self.model(inputs, docs), labels, batch.rows[i])
        return self.backward_each(batch, divisor, loss_of)
