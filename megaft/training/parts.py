"""The parts a run is composed of, each built by a named function from the config and the grid.

`TrainSpec` bundles the builders (torchtitan's train_spec idea): the `Trainer` calls
them in order and never reaches into what they return. A feature that changes one
part (an adapter model, another data store, a reference path for verification)
passes a spec with that builder replaced, instead of growing the trainer.

    data     build_data(cfg, grid)                       -> DataParts
    kernels  choose_kernels(cfg, grid)                   -> (KernelsConfig, record for summary.json)
    model    build_model(cfg, grid, kernels)             -> Llama | StageModel (this rank's shard)
    optim    build_optim(cfg, grid, model)               -> OptimParts (flat buffers, optimizer, reducer, scaler)
    step     build_step(cfg, grid, model, optim, phases) -> PlainStep | PipelineStep, picked once
    records  build_records(cfg, grid, run_dir)           -> Records (metrics, checkpoints, guards)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from tokenizers import Tokenizer

from megaft import checkpoint
from megaft.config import Config
from megaft.data import (
    EncodedCorpus,
    Examples,
    PackedDocs,
    PackedStream,
    Task,
    build_tokenizer,
    chat_encoder,
    data_sources,
    encode_examples,
    eval_batches,
    load_examples,
    prepare_dataset,
    read_source,
    special_ids,
)
from megaft.kernels.autotune import decide_kernels
from megaft.models.docs import Docs
from megaft.models.llama import Llama
from megaft.optim import LossScaler, build_optimizer
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid
from megaft.peft import apply_lora
from megaft.peft.base import lora_record
from megaft.pipeline.runtime import PipelineRuntime
from megaft.pipeline.stage import StageModel, sync_tied_grads
from megaft.training.config import accumulation_steps, use_tensorboard
from megaft.training.evaluate import eval_loss, pipeline_eval_loss
from megaft.training.guards import BadStepGuard, model_signature
from megaft.training.metrics import MetricsLog
from megaft.training.phases import PhaseTimer
from megaft.training.stop import StepBoundary
from megaft.training.stragglers import StragglerMonitor

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DataParts:
    """The tokenizer, the training stream (a pure function of (seed, step)) and the eval set."""

    tokenizer: Tokenizer
    eos_id: Optional[int]
    task: Optional[Task]  # the generated task scored by exact match, when there is one
    stream: PackedStream | PackedDocs
    eval_batches: Batches
    packing: str = "stream"  # data.packing: docs keeps documents apart in attention

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, Optional[Docs]]:
        """(input_ids, labels, document layout or None) of step `step`'s global batch."""
        if self.packing != "docs":  # stream: one causal sequence; none: one example per row
            return (*self.stream.global_batch(step, size), None)
        batch = self.stream.doc_batch(step, size)
        return batch.input_ids, batch.labels, Docs(batch.position_ids, batch.doc_ids)


def build_data(cfg: Config, grid: ParallelGrid) -> DataParts:
    """Tokenizer, training stream and eval batches of cfg.data. Conversations are rendered
    with the chat template; packing=docs|none packs whole documents (megaft.data.packed),
    from the prepared, memory-mapped store for files (megaft.data.prepare: prepared once,
    usually by the launcher before any rank starts), in memory for a generated task."""
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
        corpus = (prepare_dataset(data, init_from=init_from, eos_token_id=eos_token, tok=tok, progress=grid.rank == 0)
                  if from_store else EncodedCorpus(encode_examples(tok, examples.train, eos_id, chat=chat)))
        stream = PackedDocs(corpus, data.seq_len, data.seed, pad_id=pad_id, packing=data.packing,
                            long_docs=data.long_docs, weights=[s.weight for s in data_sources(data)] or None)
    if examples is None:  # the eval lines are few: read them in memory
        evals = read_source(data.eval_path, max_lines=data.eval_max_lines) if data.eval_path else []
        examples = Examples([], evals, None)
    evals = eval_batches(encode_examples(tok, examples.eval, eos_id, chat=chat), cfg.train.eval_batch_size,
                         pad_id, max_len=cfg.model.max_seq_len)
    return DataParts(tok, eos_id, examples.task, stream, evals, data.packing)


def choose_kernels(cfg: Config, grid: ParallelGrid):
    """(KernelsConfig, record): kernels.backend=auto on CUDA set to the backends measured
    fastest (rank 0 decides for all ranks), and each op's backend and its source for
    summary.json (megaft.kernels.autotune.decide_kernels)."""
    return decide_kernels(cfg.kernels, cfg.model, tp=grid.tp_size, batch=cfg.train.micro_batch_size,
                          seq=cfg.data.seq_len, precision=cfg.precision, device=grid.device, rank=grid.rank,
                          master_weights=cfg.optim.master_weights)


def build_model(cfg: Config, grid: ParallelGrid, kernels=None) -> Llama | StageModel:
    """The sharded model on this rank's device: HF weights or a tp-independent init.
    Under pp > 1 it is this rank's pipeline stages (`StageModel`, same parameter names).
    `kernels`: the decided KernelsConfig (default: choose_kernels)."""
    par = cfg.parallel
    if kernels is None:
        kernels = choose_kernels(cfg, grid)[0]
    if grid.pp_size > 1:
        model = StageModel(cfg.model, pp=grid.pp_size, pp_rank=grid.pp_rank, vpp=par.vpp, pp_layers=par.pp_layers,
                           group=grid.tp_group, sequence_parallel=par.sequence_parallel, kernels=kernels)
    else:
        model = Llama(cfg.model, group=grid.tp_group, sequence_parallel=par.sequence_parallel, kernels=kernels)
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


@dataclass
class OptimParts:
    """Flat parameter/gradient buffers, the (ZeRO-sharded) optimizer, the bucketed dp
    reduction and the fp16 loss scaler (None otherwise; the optimizer saves it)."""

    flat: Any
    optimizer: Any
    reducer: Any
    scaler: Optional[LossScaler]


def build_optim(cfg: Config, grid: ParallelGrid, model: torch.nn.Module) -> OptimParts:
    scaler = None
    if cfg.precision == "fp16":
        scaler = LossScaler(init_scale=cfg.optim.loss_scale, growth_interval=cfg.optim.loss_scale_window)
    flat, optimizer, reducer = build_optimizer(
        model, cfg.optim, zero=cfg.parallel.zero, bucket_mb=cfg.parallel.bucket_mb, grid=grid,
        norm_params=model.norm_params() if grid.pp_size > 1 else None, compression=cfg.parallel,
        offload=cfg.parallel.offload, scaler=scaler)
    return OptimParts(flat, optimizer, reducer, scaler)


class PlainStep:
    """Forward and backward of each micro-batch through the whole model (pp = 1); the dp
    buckets reduce during the last backward."""

    def __init__(self, model: Llama, reducer, grid: ParallelGrid, phases: PhaseTimer):
        self.model, self.reducer, self.grid, self.phases = model, reducer, grid, phases

    def forward_backward(self, micro_in: list, micro_lab: list, divisor: float, autocast,
                         micro_docs: Optional[list] = None) -> torch.Tensor:
        """Backpropagate sum(loss) / divisor over the micro-batches; returns the loss sum (fp64).
        `micro_docs`: each micro-batch's packed-document layout (data.packing=docs), or None."""
        device, phase = self.grid.device, self.phases.phase
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, (mb_in, mb_lab) in enumerate(zip(micro_in, micro_lab)):
            if i == len(micro_in) - 1:
                self.reducer.arm()  # buckets reduce during the last backward only
            docs = micro_docs[i] if micro_docs else None
            with phase("forward"), autocast():
                loss = self.model.loss_sum(mb_in.to(device), mb_lab.to(device), docs)
            with phase("backward"):
                (loss / divisor).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    def eval_loss(self, batches: Batches, autocast) -> Optional[float]:
        return eval_loss(self.model, batches, self.grid, autocast)

    @property
    def generator(self):
        """What greedy generation runs through (megaft.training.evaluate.eval_accuracy)."""
        return self.model

    @property
    def current_action(self):
        """The pipeline action in hand, for hang reports: none without a pipeline."""
        return None


class PipelineStep:
    """The rank's pipeline schedule over the micro-batches (pp > 1); the dp reduction runs
    after it (the reducer is not armed), and the tied embedding copies sum their grads."""

    def __init__(self, model: StageModel, grid: ParallelGrid, cfg: Config, phases: PhaseTimer):
        self.model, self.grid, self.phases = model, grid, phases
        self.runtime = PipelineRuntime(model, grid, cfg.parallel.schedule,
                                       accumulation_steps(cfg.train, grid.dp_size), cfg.parallel.vpp,
                                       wrap_compute=phases.timed_handler)

    def forward_backward(self, micro_in: list, micro_lab: list, divisor: float, autocast,
                         micro_docs: Optional[list] = None) -> torch.Tensor:
        loss_sum = self.runtime.train_step(list(micro_in), list(micro_lab), divisor, autocast, micro_docs)
        self.phases.add("comm", self.runtime.wait_s)
        with self.phases.phase("comm"):
            sync_tied_grads(self.model, self.grid.embedding_group)
            all_reduce(loss_sum, self.grid.pp_group)  # the last stage's loss, on every pp rank
        return loss_sum

    def eval_loss(self, batches: Batches, autocast) -> Optional[float]:
        return pipeline_eval_loss(self.runtime, batches, self.grid, autocast)

    @property
    def generator(self):
        return self.runtime  # greedy generation through the stages

    @property
    def current_action(self):
        return self.runtime.current_action


def build_step(cfg: Config, grid: ParallelGrid, model, optim: OptimParts,
               phases: PhaseTimer) -> PlainStep | PipelineStep:
    if grid.pp_size > 1:
        return PipelineStep(model, grid, cfg, phases)
    return PlainStep(model, optim.reducer, grid, phases)


@dataclass
class Records:
    """What a run writes and watches: metrics.jsonl (and TensorBoard), the checkpoint writer
    (its manifests carry the model record resume checks, and a LoRA run's base), the
    agreement on where to stop, the non-finite-step guard and the per-rank step times."""

    metrics: MetricsLog
    writer: checkpoint.CheckpointWriter
    boundary: StepBoundary
    guard: BadStepGuard
    stragglers: StragglerMonitor

    @property
    def checkpoint_dir(self) -> str:
        return self.writer.root


def build_records(cfg: Config, grid: ParallelGrid, run_dir: str) -> Records:
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
                   StragglerMonitor(grid, cfg.train.straggler_every, cfg.train.straggler_factor))


@dataclass(frozen=True)
class TrainSpec:
    """The builders a Trainer composes a run from; replace one to change that part."""

    data: Callable[..., DataParts] = build_data
    kernels: Callable[..., tuple] = choose_kernels
    model: Callable[..., torch.nn.Module] = build_model
    optim: Callable[..., OptimParts] = build_optim
    step: Callable[..., PlainStep | PipelineStep] = build_step
    records: Callable[..., Records] = build_records
