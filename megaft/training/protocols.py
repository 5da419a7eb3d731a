"""The typed surface of a run's parts, and the one signature their builders share.

A run is composed of parts (torchtitan's train_spec idea), each built by a function of the
`RunParts` built before it, in `TrainSpec` order (megaft.training.parts):

    data     DataPart     a step's micro-batches on this rank, the eval set
    kernels  Kernels      the decided KernelsConfig and its record for summary.json
    model    nn.Module    this rank's shard (Decoder, or its pipeline stages: StageModel)
    optim    OptimPart    the optimizer's whole sequence: reduce, unscale, norm, clip, step, zero
    step     StepPart     forward and backward of a step (plain or pipeline), and evaluation
    records  RecordsPart  metrics, config.yaml, checkpoints, the stop agreement, guards
    export   ExportPart   the final model in Hugging Face (or peft) form

The Trainer calls these methods and nothing else of a part, so a part can be replaced (an
adapter model, a fault injected for megaft-verify's tests) without the trainer knowing.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, TypeVar

import torch

from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.phases import PhaseTimer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from megaft.config.kernels import KernelsConfig
    from megaft.data.tasks import Task
    from megaft.models.attention.documents import Docs
    from megaft.training.summary import RunSummary

Batches = list[tuple[torch.Tensor, torch.Tensor]]
Autocast = Callable[[], contextlib.AbstractContextManager]


@dataclass
class StepBatch:
    """One optimizer step's data on this rank: its micro-batches (its dp share of the global
    batch; under cp its chunks of their tokens) and the counts of the whole global batch."""

    inputs: list[torch.Tensor]
    labels: list[torch.Tensor]
    docs: Optional[list[Docs]]  # each micro-batch's packed-document layout (data.packing=docs), else None
    n_targets: int  # target tokens of the global batch (at least 1): the loss is their mean
    tokens: int  # tokens of the global batch (throughput)
    pixels: Optional[list[torch.Tensor]] = None  # each micro-batch's images [images, 3, H, W] (a VLM), else None
    grids: Optional[list[torch.Tensor]] = None  # Qwen2.5-VL: each micro-batch's images' (t, h, w) [images, 3]
    vision_flops: float = 0.0  # a VLM's tower FLOPs over the global batch's images (MFU adds them to the text's)


@dataclass
class StepStats:
    """What one optimizer step did."""

    lr: float
    grad_norm: torch.Tensor  # 0-d, on the device: read it (.item()) after the step's last collective
    finite: bool  # False: fp16 overflow on some rank, the update was skipped on every rank
    loss_scale: Optional[float] = None  # fp16 only (after this step's update of the scale)
    skipped_steps: Optional[int] = None  # fp16 only: overflow steps so far

    def scaler_record(self) -> dict[str, float]:
        """loss_scale and skipped_steps for the metrics line, when a scaler ran."""
        if self.loss_scale is None:
            return {}
        return {"loss_scale": self.loss_scale, "skipped_steps": self.skipped_steps}


@dataclass
class Kernels:
    """The kernels part: what the model is built with, and why, for summary.json."""

    config: KernelsConfig
    record: dict[str, Any]  # op -> {backend, source[, ms]} (megaft.kernels.autotune)


class DataPart(Protocol):
    """The tokenizer, the training stream (a pure function of (seed, step)) and the eval set."""

    tokenizer: Tokenizer
    eos_id: Optional[int]
    task: Optional[Task]  # a generated task scored by exact match, when there is one
    eval_batches: Batches
    packing: str  # data.packing

    def batch(self, step: int) -> StepBatch: ...

    # what train.global_batch_size counts (sequences, pairs, completions): how many the first `epochs`
    # epochs hold, what train.epochs becomes steps by (megaft.training.epochs)
    unit: str

    def units_in(self, epochs: Fraction) -> Fraction: ...


class OptimPart(Protocol):
    """Flat buffers, the (ZeRO-sharded) optimizer, the bucketed dp reduction and the fp16 loss
    scaler behind one surface that owns the order of an optimizer step."""

    def loss_divisor(self, n_targets: int) -> float: ...

    def arm_reduction(self) -> None: ...

    def step(self, lr: float) -> StepStats: ...

    def whole_params(self) -> contextlib.AbstractContextManager: ...

    def take_sent_bytes(self) -> int: ...

    def memory_bytes(self) -> dict[str, int]: ...

    def capture(self, step: int) -> dict[str, Any]: ...

    def restore(self, checkpoint_dir: str, meta: dict[str, Any]) -> Optional[int]: ...


class StepPart(Protocol):
    """Forward and backward of a step's micro-batches, and evaluation through the same path."""

    autocast: Autocast  # the precision's autocast context (a new one per call)
    reference_s: Optional[float]  # seconds spent scoring a preference reference before step 1, else None

    def forward_backward(self, batch: StepBatch, divisor: float) -> torch.Tensor: ...

    def total_loss(self, loss_sum: torch.Tensor) -> torch.Tensor: ...

    def step_metrics(self) -> dict[str, float]: ...  # the objective's own step metrics (MoE router, rewards/*)

    def finish_step(self) -> None: ...  # after the optimizer step and step_metrics (MoE correction biases)

    def eval_loss(self, batches: Batches) -> Optional[float]: ...

    @property
    def generator(self) -> Any: ...

    @property
    def current_action(self) -> Any: ...


class RecordsPart(Protocol):
    """What a run writes and watches: config.yaml, metrics.jsonl, checkpoints, summary.json,
    the agreement on where to stop, the non-finite-step guard, the per-rank step times."""

    checkpoint_dir: str
    meta: dict[str, Any]  # what a checkpoint's manifest records beside the shards (resume checks it)

    def start(self, cfg: Config) -> None: ...

    def log(self, **line: Any) -> None: ...

    def log_train(self, step: int, out: dict[str, Any], seconds: float, *, comm_bytes: int,
                  mfu: dict[str, float]) -> None: ...

    def resumed_at(self, step: int) -> None: ...

    def agree(self, flag: int) -> int: ...

    def should_save(self, done: int, end: int, *, force: bool) -> bool: ...

    def save(self, step: int, state: dict[str, Any]) -> None: ...

    def finish_saves(self) -> None: ...

    def write_summary(self, summary: RunSummary) -> None: ...

    def close(self) -> None: ...


class ExportPart(Protocol):
    """The trained model written for other tools (train.export_hf), and the run's own tokenizer."""

    def save_own_tokenizer(self) -> None: ...

    def write(self) -> None: ...


@dataclass
class RunParts:
    """A run's parts as they are built: each builder gets this, with the parts before its own
    filled in (TrainSpec order), and returns its part."""

    cfg: Config
    grid: ParallelGrid
    run_dir: str = ""
    phases: Optional[PhaseTimer] = None  # per-phase step times; made from train.log_phases when None
    data: Optional[DataPart] = None
    kernels: Optional[Kernels] = None
    model: Optional[torch.nn.Module] = None  # Decoder | StageModel
    optim: Optional[OptimPart] = None
    step: Optional[StepPart] = None
    records: Optional[RecordsPart] = None
    export: Optional[ExportPart] = None

    def __post_init__(self):
        if self.phases is None:
            self.phases = PhaseTimer(self.grid.device, enabled=self.cfg.train.log_phases)


T = TypeVar("T")
Builder = Callable[[RunParts], T]  # the one signature of every part's builder
