"""DataConfig (`data.*`): where examples come from and how they are cut into sequences, with
the fine-tuning options of a fixed set of values as enums (Hydra rejects other values when
composing, naming the allowed ones). Reading, checking and tokenizing the data is
megaft.data's (checks.check_data, build.build_tokenizer/load_examples)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional


class TrainOn(StrEnum):  # the conversation tokens with a loss (megaft.data.chat)
    assistant = "assistant"
    all = "all"
    last = "last"  # the last assistant turn


class Packing(StrEnum):  # megaft.data.packed
    docs = "docs"  # whole documents, kept apart in attention
    stream = "stream"  # one continuous stream
    none = "none"  # one document per row


class VerifyStore(StrEnum):  # how much of a prepared store is checked when it is opened (megaft.data.store)
    sizes = "sizes"  # every array's size against the manifest
    full = "full"  # and its sha256 and largest token id (once per change of the files)


class LongDocs(StrEnum):  # documents longer than seq_len under packing=docs|none (data.long_docs stays a str)
    split = "split"
    truncate = "truncate"
    drop = "drop"


@dataclass
class SourceConfig:
    """One entry of data.sources."""

    path: str = "???"  # a .jsonl/.parquet file or a directory of them
    weight: float = 1.0  # times each example appears per epoch (fractions draw a seeded subset)


@dataclass
class DataConfig:
    """Where examples come from and how they are cut into sequences."""

    path: Optional[str] = None  # JSONL train file (see megaft.data.jsonl); None = generated task
    eval_path: Optional[str] = None  # JSONL eval file; None = task's held-out set (none for files)
    tokenizer: Optional[str] = None  # tokenizer.json or its dir; None = init_from's, else task's
    seq_len: int = 64  # tokens per packed training sequence
    task: str = "addition"  # generated task used when path is None (see megaft.data.tasks.TASKS)
    task_train_size: int = 20000  # generated training examples (repeats allowed)
    task_eval_size: int = 256  # generated held-out prompts, never in the training set
    seed: int = 1234  # generates the task and shuffles each epoch's packing order
    eval_max_lines: Optional[int] = None  # read at most this many examples of eval_path; None = all
    # Fine-tuning data (megaft.data.formats/sources/chat/plan/prepare). Defaults keep the demo as it was.
    sources: list[SourceConfig] = field(default_factory=list)  # [{path, weight}] mixed; instead of path
    chat_template: str = "auto"  # auto (the checkpoint's) | llama3 | chatml | path to a .jinja file
    train_on: TrainOn = TrainOn.assistant  # conversation tokens with a loss: assistant | all | last (assistant turn)
    packing: Packing = Packing.stream  # stream: one continuous stream | docs: documents kept apart | none: one a row
    # a str checked against LongDocs: an enum member named `split` would hide str.split on the value
    long_docs: str = "split"  # documents longer than seq_len (packing=docs|none): split | truncate | drop
    cache_dir: Optional[str] = None  # prepared datasets live here; None = ~/.cache/megaft/prepared
    prepare_workers: int = 0  # processes tokenizing while preparing; 0 = min(8, CPUs)
    # a prepared store's check when opened: sizes | full (sha256 + largest token id, once per change)
    verify_store: VerifyStore = VerifyStore.full


def data_sources(cfg: DataConfig) -> list[SourceConfig]:
    """The training sources: data.sources, else data.path as one source of weight 1."""
    if cfg.sources:
        return list(cfg.sources)
    return [SourceConfig(cfg.path, 1.0)] if cfg.path is not None else []
