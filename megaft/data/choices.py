"""The fine-tuning data options with a fixed set of values (`data.train_on`, `data.packing`,
`data.long_docs`), as enums: Hydra rejects other values when composing, naming the
allowed ones. Stdlib only, so the config, the chat encoder and the packer share them."""
from __future__ import annotations

from enum import StrEnum


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
