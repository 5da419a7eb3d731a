"""train.objective=sft: next-token cross-entropy over the target tokens (token-weighted, fp32).

The data part: text, prompt/completion, conversations (the chat template) and generated
tasks, packed as a stream or as documents kept apart, from the prepared store or in memory;
a step's global batch split over dp (and cp) into micro-batches. The step part: the plain or
pipelined forward/backward of megaft.training.step.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch
from tokenizers import Tokenizer

from megaft.config.data import data_sources
from megaft.data.batches import PackedStream, count_targets, eval_batches
from megaft.data.build import Examples, build_tokenizer, chat_encoder, load_examples
from megaft.data.encode import encode_examples
from megaft.data.packed import EncodedCorpus, PackedDocs
from megaft.data.sources import read_source
from megaft.data.tasks import Task
from megaft.data.tokenizer import special_ids
from megaft.models.attention.documents import Docs
from megaft.models.vision.checks import trains_images
from megaft.parallel.context import context_shard
from megaft.parallel.grid import ParallelGrid
from megaft.training.agreed import agreed_store
from megaft.training.objectives import images
from megaft.training.protocols import Batches, RunParts, StepBatch
from megaft.training.step import build_step as build_text_step

__all__ = ["DataParts", "build_data", "build_step", "micro_batches"]


def micro_batches(inputs: torch.Tensor, labels: torch.Tensor, docs: Optional[Docs], grid: ParallelGrid,
                  size: int) -> tuple[list, list, Optional[list]]:
    """This rank's micro-batches of a global batch: its dp share of the rows and, under
    context parallelism, its cp chunks of their tokens (megaft.parallel.context.context_shard)."""
    share = inputs.shape[0] // grid.dp_size
    rows = slice(grid.dp_rank * share, (grid.dp_rank + 1) * share)
    micro_in, micro_lab = list(inputs[rows].split(size)), list(labels[rows].split(size))
    micro_docs = None if docs is None else [
        Docs(p, d) for p, d in zip(docs.position_ids[rows].split(size), docs.doc_ids[rows].split(size))]
    if grid.cp_size > 1:
        parts = [context_shard(i, lab, d, grid.cp_group)
                 for i, lab, d in zip(micro_in, micro_lab, micro_docs or [None] * len(micro_in))]
        micro_in, micro_lab = [p[0] for p in parts], [p[1] for p in parts]
        micro_docs = [Docs(*p[2:]) for p in parts]  # positions, doc ids and the ContextShard the ring reads
    return micro_in, micro_lab, micro_docs


@dataclass
class DataParts:
    """The tokenizer, the training stream (a pure function of (seed, step)) and the eval set;
    `batch(step)` is this rank's share of step `step`'s global batch (of `global_batch_size`
    sequences, in micro-batches of `micro_batch_size`, split over `grid`)."""

    tokenizer: Tokenizer
    eos_id: Optional[int]
    task: Optional[Task]  # the generated task scored by exact match, when there is one
    stream: PackedStream | PackedDocs
    eval_batches: Batches
    packing: str  # data.packing: docs keeps documents apart in attention
    grid: ParallelGrid
    global_batch_size: int  # train.global_batch_size
    micro_batch_size: int  # train.micro_batch_size
    # training conversations with no assistant turn under data.train_on=assistant (None: no chat data)
    untrained: Optional[int] = None

    unit = "sequences"

    def units_in(self, epochs: Fraction) -> Fraction:
        """The packed sequences of the first `epochs` epochs."""
        return self.stream.sequences_in(epochs)

    def batch(self, step: int) -> StepBatch:
        """Step `step`'s micro-batches on this rank, with the global batch's target and token counts."""
        inputs, labels, docs = self.global_batch(step, self.global_batch_size)
        n_targets = max(count_targets(labels), 1)
        micro_in, micro_lab, micro_docs = micro_batches(inputs, labels, docs, self.grid, self.micro_batch_size)
        return StepBatch(micro_in, micro_lab, micro_docs, n_targets, int(inputs.numel()))

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, Optional[Docs]]:
        """(input_ids, labels, document layout or None) of step `step`'s global batch."""
        if self.packing != "docs":  # stream: one causal sequence; none: one example per row
            return (*self.stream.global_batch(step, size), None)
        batch = self.stream.doc_batch(step, size)
        return batch.input_ids, batch.labels, Docs(batch.position_ids, batch.doc_ids)


def build_step(parts: RunParts):
    """sft's step part: the plain or pipelined text step (megaft.training.step), or the step
    that feeds each micro-batch's images (megaft.training.objectives.images)."""
    return images.build_step(parts) if trains_images(parts.cfg) else build_text_step(parts)


def build_data(parts: RunParts) -> DataParts:
    """Tokenizer, training stream and eval batches of cfg.data. Conversations are rendered
    with the chat template; packing=docs|none packs whole documents (megaft.data.packed),
    from the prepared, memory-mapped store for files (megaft.data.prepare: prepared once,
    usually by the launcher before any rank starts), in memory for a generated task.
    A multimodal Gemma 3 reads conversations with images (megaft.training.objectives.images)."""
    cfg, grid = parts.cfg, parts.grid
    if trains_images(cfg):
        return images.build_data(parts)
    data, init_from = cfg.data, cfg.model.init_from
    tok = build_tokenizer(data, init_from=init_from)
    eos_token = cfg.model.extra.get("eos_token_id")
    eos_id, pad_id = special_ids(tok, eos_token)
    chat = chat_encoder(data, tok, init_from=init_from)  # None: no template (plain text and tasks)
    from_store = data.packing != "stream" and bool(data_sources(data))  # files: never whole in memory
    examples = None if from_store else load_examples(data)
    if data.packing == "stream":
        stream = PackedStream(encode_examples(tok, examples.train, eos_id, chat=chat), data.seq_len, data.seed)
    else:
        corpus = (agreed_store(data, grid, init_from=init_from, eos_token_id=eos_token, tok=tok) if from_store
                  else EncodedCorpus(encode_examples(tok, examples.train, eos_id, chat=chat)))
        stream = PackedDocs(corpus, data.seq_len, data.seed, pad_id=pad_id, packing=data.packing,
                            long_docs=data.long_docs, weights=[s.weight for s in data_sources(data)] or None)
    # counted by the store's preparation, or by the chat encoder before it encodes the eval set
    untrained = corpus.manifest["counts"].get("conversations_without_assistant") if from_store else \
        (chat.untrained if chat is not None else None)
    if examples is None:  # the eval lines are few: read them in memory
        evals = read_source(data.eval_path, max_lines=data.eval_max_lines) if data.eval_path else []
        examples = Examples([], evals, None)
    evals = eval_batches(encode_examples(tok, examples.eval, eos_id, chat=chat), cfg.train.eval_batch_size,
                         pad_id, max_len=cfg.model.max_seq_len)
    return DataParts(tok, eos_id, examples.task, stream, evals, data.packing, grid, cfg.train.global_batch_size,
                     cfg.train.micro_batch_size, untrained)
