"""train.objective=sft on conversations with images: a multimodal Gemma 3 or a Qwen2.5-VL
(megaft.models.vision).

The data part reads the image chat file once on every rank (megaft.data.image_chat: pixels
and image tokens as the checkpoint's processor makes them, Qwen2.5-VL's images as patches with
their grids; a conversation longer than data.seq_len is dropped whole and counted, never cut).
A step's global batch is a pure function of (seed, step): a seeded permutation of the
conversations per epoch. It is padded to its longest row as one batch, so every layout
computes on the same shapes, then split over dp into micro-batches, each with its rows'
images in order. The step part runs the model's loss with those pixels; the loss is the
token-weighted mean over the global batch, as sft's.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

import torch
from tokenizers import Tokenizer

from megaft.data.build import build_tokenizer, chat_encoder
from megaft.data.errors import DataError
from megaft.data.image_chat import ImageChatEncoder, ImageSample, collate, image_processing, read_image_chat
from megaft.data.tokenizer import special_ids
from megaft.models.vision.checks import FREEZABLE
from megaft.models.vision.family import vision_config_of
from megaft.models.vision.staged import ImageInputs
from megaft.parallel.grid import ParallelGrid
from megaft.perf.vision import images_flops
from megaft.pipeline.vision import VisionStages
from megaft.training.protocols import Batches, RunParts, StepBatch
from megaft.training.step import PipelineStep, _Step, precision_autocast


@dataclass
class ImageDataPart:
    """The conversations with images and the order a run reads them in; `batch(step)` is this
    rank's micro-batches of step `step`'s global batch, pixels beside ids and labels."""

    tokenizer: Tokenizer
    eos_id: Optional[int]
    samples: list[ImageSample]
    pad_id: int
    grid: ParallelGrid
    global_batch_size: int
    micro_batch_size: int
    seed: int
    dropped_long: int  # conversations longer than data.seq_len, dropped whole (summary.json)
    untrained: Optional[int] = None  # conversations with no assistant turn under train_on=assistant
    image_flops: Optional[list[float]] = None  # each conversation's images' tower FLOPs (megaft.perf.vision)
    task = None
    packing = "none"
    unit = "conversations"
    eval_batches: Batches = field(default_factory=list)
    _orders: dict = field(default_factory=dict, repr=False)

    def units_in(self, epochs: Fraction) -> Fraction:
        return len(self.samples) * epochs

    def order(self, epoch: int) -> list[int]:
        """The conversations of `epoch` in their seeded order (the same on every rank)."""
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._orders[epoch] = torch.randperm(len(self.samples), generator=gen).tolist()
        return self._orders[epoch]

    def row_ids(self, step: int) -> list[int]:
        """The conversations (indices into `samples`) of step `step`'s global batch, epochs following
        each other without a gap."""
        n = len(self.samples)
        first = step * self.global_batch_size
        return [self.order(i // n)[i % n] for i in range(first, first + self.global_batch_size)]

    def rows(self, step: int) -> list[ImageSample]:
        """The global batch of step `step`."""
        return [self.samples[i] for i in self.row_ids(step)]

    def batch(self, step: int) -> StepBatch:
        ids = self.row_ids(step)
        rows = [self.samples[i] for i in ids]
        whole = collate(rows, self.pad_id)  # padded to the global batch's longest row, in every layout
        starts = [0, *itertools.accumulate(len(s.pixels) for s in rows)]  # each row's first image (Qwen: patch)
        firsts = None if whole.grids is None else [0, *itertools.accumulate(len(s.grids) for s in rows)]
        share = len(rows) // self.grid.dp_size
        first = self.grid.dp_rank * share
        inputs, labels, pixels, grids = [], [], [], []
        for r in range(first, first + share, self.micro_batch_size):
            end = r + self.micro_batch_size
            inputs.append(whole.input_ids[r:end])
            labels.append(whole.labels[r:end])
            pixels.append(whole.pixels[starts[r]:starts[end]])
            if firsts is not None:  # Qwen2.5-VL: the images' grids beside their patches
                grids.append(whole.grids[firsts[r]:firsts[end]])
        flops = sum(self.image_flops[i] for i in ids) if self.image_flops else 0.0
        return StepBatch(inputs, labels, None, max(whole.n_targets, 1), int(whole.input_ids.numel()), pixels,
                         grids if firsts is not None else None, flops)


def build_data(parts: RunParts) -> ImageDataPart:
    """The image chat file data.path read with the checkpoint's tokenizer, chat template and
    image processor (validation refused every other source before any rank started)."""
    cfg = parts.cfg
    data, ckpt = cfg.data, cfg.model.init_from
    tok = build_tokenizer(data, init_from=ckpt)
    eos_id, pad_id = special_ids(tok, cfg.model.extra.get("eos_token_id"))
    chat = chat_encoder(data, tok, init_from=ckpt)
    proc = image_processing(ckpt)
    if chat is None:
        raise DataError(f"{data.path}: image chats need a chat template and {ckpt} has none; fix: "
                        f"data.chat_template=PATH of a Jinja template that writes {proc.marker} per image")
    read = read_image_chat(data.path, ImageChatEncoder(chat, proc), data.seq_len)
    if not read.samples:
        raise DataError(f"{data.path}: no conversation fits data.seq_len={data.seq_len} ({read.dropped_long} "
                        "dropped whole, never cut); fix: raise data.seq_len")
    return ImageDataPart(tok, eos_id, read.samples, pad_id, parts.grid, cfg.train.global_batch_size,
                         cfg.train.micro_batch_size, data.seed, read.dropped_long, chat.untrained,
                         tower_costs(cfg, read.samples))


def tower_costs(cfg, samples: list[ImageSample]) -> list[float]:
    """Each conversation's images' tower FLOPs in a training step (megaft.perf.vision.image_flops: 3
    forwards, or 1 when neither the tower nor the projector trains)."""
    vcfg = vision_config_of(cfg.model.init_from, base=cfg.model)
    trains = cfg.lora.rank <= 0 and not set(FREEZABLE) <= set(cfg.model.freeze)
    return [images_flops(vcfg, len(s.pixels), None if s.grids is None else s.grids.tolist(), trains=trains)
            for s in samples]


class _DenseWithoutEval:
    """What an image step has none of, at any pp: router statistics (a dense language model) and an eval
    loss (data.eval_path is refused with images, megaft.models.vision.checks)."""

    def step_metrics(self) -> dict[str, float]:
        return {}

    def finish_step(self) -> None:
        pass

    def eval_loss(self, batches: Batches) -> Optional[float]:
        return None


class ImageStep(_DenseWithoutEval, _Step):
    """Forward and backward of each micro-batch, its images fed to the tower (pp = 1); the dp
    buckets reduce during the last backward, as PlainStep's."""

    def __init__(self, model, optim, grid: ParallelGrid, phases, autocast):
        super().__init__(grid, phases, autocast)
        self.model, self.optim = model, optim

    def forward_backward(self, batch: StepBatch, divisor: float) -> torch.Tensor:
        device, phase = self.grid.device, self.phases.phase
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        grids = batch.grids or [None] * len(batch.inputs)
        for i, (ids, labels, pixels, grid) in enumerate(zip(batch.inputs, batch.labels, batch.pixels, grids)):
            if i == len(batch.inputs) - 1:
                self.optim.arm_reduction()  # buckets reduce during the last backward only
            images = () if grid is None else (grid if len(grid) else None,)  # Qwen2.5-VL: the images' grids
            with phase("forward"), self.autocast():
                loss = self.model.loss_sum(ids.to(device), labels.to(device),
                                           pixels.to(device) if len(pixels) else None, *images)
            with phase("backward"):
                (loss / divisor).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    @property
    def generator(self):
        return self.model

    @property
    def current_action(self):
        return None


class PipelineImageStep(_DenseWithoutEval, PipelineStep):
    """The rank's pipeline schedule over the micro-batches (pp > 1), each micro-batch's images
    beside its ids (`ImageInputs`, in the runtime's per-micro-batch `docs` slot): the first
    stage runs the tower, every stage builds the attention layout from the ids
    (megaft.models.vision.staged)."""

    def forward_backward(self, batch: StepBatch, divisor: float) -> torch.Tensor:
        grids = batch.grids or [None] * len(batch.inputs)
        images = [ImageInputs(ids, pixels if len(pixels) else None,
                              () if grid is None else (grid if len(grid) else None,))
                  for ids, pixels, grid in zip(batch.inputs, batch.pixels, grids)]
        return self.run_schedule(dataclasses.replace(batch, docs=images), divisor)


def build_step(parts: RunParts) -> ImageStep | PipelineImageStep:
    autocast = precision_autocast(parts.cfg.precision, parts.grid.device)
    # ZeRO-3 gathers the tower's parameters collectively over dp: every rank runs it on every micro-batch
    # (a frozen tower is not sharded, so not gathered: then a micro-batch without images skips it); under
    # pp only the first stage's ranks hold it, and they all run the same schedule
    tower = [p for n, p in parts.model.named_parameters() if not n.startswith("language_model.")]
    parts.model.tower_every_step = getattr(parts.optim.optimizer, "gatherer", None) is not None and \
        any(p.requires_grad for p in tower)
    if parts.grid.pp_size > 1:
        return PipelineImageStep(VisionStages(parts.model), parts.grid, parts.cfg, parts.phases, autocast)
    return ImageStep(parts.model, parts.optim, parts.grid, parts.phases, autocast)
