"""The parts a run is composed of, each built by a named function of the parts before it.

`TrainSpec` bundles the builders (torchtitan's train_spec idea): the `Trainer` builds
them in order and calls only their typed surface (megaft.training.protocols). A feature
that changes one part (an adapter model, another data store, a fault for megaft-verify's
tests) passes a spec with that builder replaced, instead of growing the trainer. Every
builder has one signature, `builder(parts: RunParts) -> part`:

    data     build_data      -> the objective's data part: a step's micro-batches on this rank, the eval set
    kernels  choose_kernels  -> Kernels: the decided KernelsConfig and its summary.json record
    model    build_model     -> Decoder | StageModel (this rank's shard; megaft.training.model)
    optim    build_optim     -> OptimParts (megaft.training.optimizer): the optimizer step's sequence
    step     build_step_part -> the objective's step part (PlainStep | PipelineStep for sft, the
                                preference steps for dpo...), picked once
    records  build_records   -> Records (megaft.training.records): config.yaml, metrics, checkpoints
    export   build_export    -> HFExport (megaft.training.export): the model for other tools

The data and step parts are train.objective's (megaft.training.objectives: a registry, so
the trainer never branches on the objective).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.export import build_export
from megaft.training.model import build_model, choose_kernels, model_params
from megaft.training.objectives import objective_of
from megaft.training.optimizer import build_optim
from megaft.training.protocols import (
    Builder,
    DataPart,
    ExportPart,
    Kernels,
    OptimPart,
    RecordsPart,
    RunParts,
    StepPart,
)
from megaft.training.records import build_records

__all__ = ["RunParts", "TrainSpec", "build_data", "build_export", "build_model", "build_optim", "build_records",
           "build_step_part", "choose_kernels", "model_params"]


def build_data(parts: RunParts) -> DataPart:
    """train.objective's data part (megaft.training.objectives)."""
    return objective_of(parts.cfg.train.objective).build_data(parts)


def build_step_part(parts: RunParts) -> StepPart:
    """train.objective's step part (megaft.training.objectives)."""
    return objective_of(parts.cfg.train.objective).build_step(parts)


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
