"""The parts a run is composed of, each built by a named function of the parts before it.

`TrainSpec` bundles the builders (torchtitan's train_spec idea): the `Trainer` builds
them in order and calls only their typed surface (megaft.training.protocols). A feature
that changes one part (an adapter model, another data store, a fault for megaft-verify's
tests) passes a spec with that builder replaced, instead of growing the trainer. Every
builder has one signature, `builder(parts: RunParts) -> part`:

    data     build_data      -> DataParts: a step's micro-batches on this rank, the eval set
    kernels  choose_kernels  -> Kernels: the decided KernelsConfig and its summary.json record
    model    build_model     -> Decoder | StageModel (this rank's shard)
    optim    build_optim     -> OptimParts (megaft.training.optimizer): the optimizer step's sequence
    step     build_step_part -> PlainStep | PipelineStep (megaft.training.step) | PreferenceStep
                                (megaft.training.pref_step), picked once
    records  build_records   -> Records (megaft.training.records): config.yaml, metrics, checkpoints
    export   build_export    -> HFExport (megaft.training.export): the model for other tools
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
from tokenizers import Tokenizer

from megaft.config import Config
from megaft.config.pref import is_preference
from megaft.data import (
    EncodedCorpus,
    Examples,
    PackedDocs,
    PackedStream,
    Task,
    build_tokenizer,
    chat_encoder,
    count_targets,
    data_sources,
    encode_examples,
    eval_batches,
    load_examples,
    read_source,
    special_ids,
)
from megaft.kernels.autotune import decide_kernels
from megaft.models.decoder import Decoder
from megaft.models.docs import Docs
from megaft.parallel.comm import all_reduce
from megaft.parallel.context import context_shard
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.shard import full_shape
from megaft.peft import apply_lora
from megaft.pipeline.stage import StageModel
from megaft.training.agreed import agreed_store
from megaft.training.export import build_export
from megaft.training.optimizer import build_optim
from megaft.training.pref_data import build_pref_data
from megaft.training.pref_step import PipelinePreferenceStep, PreferenceStep
from megaft.training.protocols import (
    Batches,
    Builder,
    DataPart,
    ExportPart,
    Kernels,
    OptimPart,
    RecordsPart,
    RunParts,
    StepBatch,
    StepPart,
)
from megaft.training.records import build_records
from megaft.training.step import build_step

__all__ = ["DataParts", "RunParts", "TrainSpec", "build_data", "build_export", "build_model", "build_optim",
           "build_records", "build_step", "build_step_part", "choose_kernels", "micro_batches", "model_params"]


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


def build_data(parts: RunParts) -> DataParts:
    """Tokenizer, training stream and eval batches of cfg.data. Conversations are rendered
    with the chat template; packing=docs|none packs whole documents (megaft.data.packed),
    from the prepared, memory-mapped store for files (megaft.data.prepare: prepared once,
    usually by the launcher before any rank starts), in memory for a generated task. Under a
    preference objective: the pairs (megaft.training.pref_data.build_pref_data)."""
    cfg, grid = parts.cfg, parts.grid
    if is_preference(cfg.train.objective):  # pairs (megaft.training.pref_data)
        return build_pref_data(parts)
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


def choose_kernels(parts: RunParts) -> Kernels:
    """kernels.backend=auto on CUDA set to the backends measured fastest (rank 0 decides for
    all ranks), and each op's backend and its source for summary.json
    (megaft.kernels.autotune.decide_kernels)."""
    cfg, grid = parts.cfg, parts.grid
    return Kernels(*decide_kernels(cfg.kernels, cfg.model, tp=grid.tp_size, batch=cfg.train.micro_batch_size,
                                   seq=cfg.data.seq_len, precision=cfg.precision, device=grid.device,
                                   rank=grid.rank, master_weights=cfg.optim.master_weights))


def build_model(parts: RunParts) -> Decoder | StageModel:
    """The sharded model on this rank's device: HF weights or a tp-independent init.
    Under pp > 1 it is this rank's pipeline stages (`StageModel`, same parameter names).
    Built with parts.kernels (choose_kernels when not built yet)."""
    cfg, grid = parts.cfg, parts.grid
    par = cfg.parallel
    kernels = (parts.kernels or choose_kernels(parts)).config
    if grid.pp_size > 1:
        model = StageModel(cfg.model, pp=grid.pp_size, pp_rank=grid.pp_rank, vpp=par.vpp, pp_layers=par.pp_layers,
                           group=grid.tp_group, sequence_parallel=par.sequence_parallel, kernels=kernels,
                           ep_group=grid.ep_group, routing=cfg.moe)
    else:
        model = Decoder(cfg.model, group=grid.tp_group, sequence_parallel=par.sequence_parallel, kernels=kernels,
                        ep_group=grid.ep_group, routing=cfg.moe)
    if cfg.model.init_from:
        from megaft.models.hf import load_hf_weights

        load_hf_weights(model, cfg.model.init_from, tp_rank=grid.tp_rank, tp_size=grid.tp_size,
                        strict=grid.pp_size == 1)
    else:
        from megaft.models.init import init_params

        init_params(model, cfg.model, seed=cfg.train.seed, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    if cfg.lora.rank > 0:  # LoRA: freeze the base, attach seeded adapters (megaft.peft)
        apply_lora(model, cfg.lora, seed=cfg.train.seed, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    return model.to(grid.device)


def model_params(model: torch.nn.Module, grid: ParallelGrid, *, trainable: bool = False) -> int:
    """Parameters of the whole (unsharded, unpadded) model; `trainable`: only those the
    optimizer updates (LoRA: the adapters). Under pp a sum over the stages (a collective)."""
    copy = model.embed_tokens.weight if getattr(model, "tied_copy", False) else None
    local = sum(math.prod(full_shape(p, grid.tp_size)) for p in model.parameters()
                if p is not copy and (p.requires_grad or not trainable))
    if grid.pp_size == 1:
        return local
    total = torch.tensor(float(local), dtype=torch.float64, device=grid.device)
    return int(all_reduce(total, grid.pp_group).item())


def build_step_part(parts: RunParts) -> StepPart:
    """The step of train.objective: a preference objective's (megaft.training.pref_step),
    else next-token cross-entropy's, plain or pipelined (megaft.training.step.build_step)."""
    if is_preference(parts.cfg.train.objective):
        step = PipelinePreferenceStep if parts.grid.pp_size > 1 else PreferenceStep
        return step(parts, build_model)
    return build_step(parts)


@dataclass(frozen=True)
class TrainSpec:
    """The builders a Trainer composes a run from, in build order; replace one to change that part."""

    data: Builder[DataPart] = build_data
    kernels: Builder[Kernels] = choose_kernels
    model: Builder[torch.nn.Module] = build_model
    optim: Builder[OptimPart] = build_optim
    step: Builder[StepPart] = build_step_part
    records: Builder[RecordsPart] = build_records
    export: Builder[ExportPart] = build_export

    def build(self, cfg: Config, grid: ParallelGrid, run_dir: str) -> RunParts:
        """Every part, each builder given the parts built before it."""
        parts = RunParts(cfg, grid, run_dir)
        for f in dataclasses.fields(self):
            setattr(parts, f.name, getattr(self, f.name)(parts))
        return parts
