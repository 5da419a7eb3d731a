"""summary.json: the one written record of a finished run, as the `RunSummary` dataclass.

The trainer's rank 0 writes it when a run finishes (a run stopped by a signal writes none:
it is not finished); `megaft-report`, `megaft-scale`, the planner's probes and the launchers'
restart count read and rewrite it through this class, never through string keys of their own.

Versions (`schema` in the file): 2 is this class; 1 is every summary.json written before it,
which has the same keys and no `schema`. Readers accept both. Keys this version does not know
(a newer writer, a tool's addition) are kept in `extra` and written back unchanged.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from megaft.fileio import read_json, write_json_atomic
from megaft.run_dir import SUMMARY

SCHEMA_VERSION = 2
FILE = SUMMARY
# Fields a run has only sometimes; None is then left out of the file, as before schema 2
# (readers test for the key: eval_* without eval data, peak_memory_bytes/device_name on CUDA,
# peak_rss_bytes on CPU, mfu with a known peak, restarts once a launcher counted them).
_SOMETIMES = {"metadata": {"omit_none": True}}


@dataclass
class RunSummary:
    """What a finished run did, on what layout, how fast, and at what size.

    Written by megaft.training.loop (rank 0) as summary.json; read by megaft-report (whose MFU
    comes from `flops_per_token`, `peak_tflops`, `device_name` and `precision` through
    megaft.perf), megaft-scale and megaft-plan's probes (tokens, steps, tokens_per_s)."""

    schema: int = SCHEMA_VERSION
    # the outcome
    steps: int = 0  # train.max_steps of the run
    final_loss: Optional[float] = None  # the last step's training loss
    eval_loss: Optional[float] = field(default=None, **_SOMETIMES)
    eval_accuracy: Optional[float] = field(default=None, **_SOMETIMES)
    tokens: int = 0  # tokens trained on by this attempt (a resumed run counts from its checkpoint)
    tokens_per_s: Optional[float] = None  # all those tokens over all step time
    wall_s: float = 0.0  # this attempt's time in fit(), evaluation and checkpoints included
    # the layout
    world_size: Optional[int] = None
    tp: Optional[int] = None
    dp: Optional[int] = None
    pp: Optional[int] = None
    cp: Optional[int] = None
    sequence_parallel: bool = False
    zero: int = 0
    precision: Optional[str] = None  # fp32 | bf16 | fp16
    device: str = ""  # torch device of rank 0, e.g. "cuda:0"
    device_name: Optional[str] = field(default=None, **_SOMETIMES)  # the GPU's name (MFU's peak table)
    kernels: dict[str, Any] = field(default_factory=dict)  # op -> {backend, source[, ms]} (kernels.autotune)
    attention: Optional[str] = None  # what attention ran with (megaft.models.attention.attention_record)
    packing: str = "stream"
    # the size
    model: str = ""  # model.name
    params: Optional[int] = None  # the whole unsharded model
    trainable_params: Optional[int] = None  # what the optimizer updates (LoRA: the adapters)
    n_layers: Optional[int] = None
    dim: Optional[int] = None
    seq_len: Optional[int] = None
    memory_bytes: dict[str, int] = field(default_factory=dict)  # rank 0's params/grads/optimizer bytes
    peak_memory_bytes: Optional[int] = field(default=None, **_SOMETIMES)  # CUDA: max allocated
    peak_rss_bytes: Optional[int] = field(default=None, **_SOMETIMES)  # CPU: the process's peak resident set
    # the speed (megaft.perf: model FLOPs per token, the peak it is compared with, MFU)
    flops_per_token: Optional[float] = None
    peak_tflops: Optional[float] = None
    mfu: Optional[float] = field(default=None, **_SOMETIMES)
    restarts: Optional[int] = field(default=None, **_SOMETIMES)  # launcher restarts and requeues
    # chat data: training conversations with no assistant turn, which train nothing (data.train_on=assistant)
    conversations_without_assistant: Optional[int] = field(default=None, **_SOMETIMES)
    # conversations with images longer than data.seq_len: dropped whole, never cut (megaft.data.image_chat)
    dropped_long: Optional[int] = field(default=None, **_SOMETIMES)
    # config.json keys read as metadata on the user's word (model.hf_ignore_keys), when there are any
    hf_ignore_keys: Optional[list] = field(default=None, **_SOMETIMES)
    # a mixture of experts: experts, top_k, its MoE layers, the grouped GEMM and the token dispatch
    # (megaft.models.moe.metrics.moe_record)
    moe: Optional[dict] = field(default=None, **_SOMETIMES)
    # a preference objective with a reference (dpo, robust, ipo): seconds scoring its log-probs before step 1
    reference_s: Optional[float] = field(default=None, **_SOMETIMES)
    # optim.name=muon: which parameters took Muon and which AdamW (megaft.optim.muon), counts and names
    optimizer: Optional[dict] = field(default=None, **_SOMETIMES)
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    def to_json(self) -> dict[str, Any]:
        """The file's object: every field (sometimes-fields only when set) and `extra`."""
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and not (value is None and f.metadata.get("omit_none")):
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "RunSummary":
        """A summary.json object of any version: without `schema` it is version 1."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in obj.items() if k in names}
        known.setdefault("schema", 1)
        return cls(**known, extra={k: v for k, v in obj.items() if k not in names})

    def write(self, run_dir: str) -> str:
        """run_dir/summary.json, written atomically (readers never see half of it); its path."""
        path = os.path.join(run_dir, FILE)
        write_json_atomic(path, self.to_json())
        return path

    @classmethod
    def read(cls, run_dir: str) -> Optional["RunSummary"]:
        """run_dir's summary.json, or None when there is none (or it is not whole yet)."""
        obj = read_json(os.path.join(run_dir, FILE))
        return cls.from_json(obj) if isinstance(obj, dict) else None
