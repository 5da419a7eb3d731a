"""The record an adapter-only checkpoint keeps of the base model it adapts.

Adapters are meaningless on another base, so every LoRA checkpoint's manifest records
`lora_record(...)`: the base checkpoint's path and a fingerprint, plus the adapter
settings that fix the adapters' tensors. Resuming compares them
(megaft.checkpoint.adapters.check_lora_base). The fingerprint is a sha256 over
config.json and the safetensors index whole, and over each weight file's name, size and
sampled content (its header and 64 KiB at its start, middle and end): two bases with
the same architecture (an instruct tune of the same model) differ in it, and
computing it reads well under a megabyte per file, whatever the model's size.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

from megaft.config.lora import LoraConfig

SAMPLE = 64 * 1024  # bytes read at each of a weight file's start, middle and end


def _sample(path: str) -> bytes:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        out = b""
        for at in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
            f.seek(at)
            out += f.read(SAMPLE)
    return out


def base_fingerprint(init_from: Optional[str], seed: int) -> str:
    """sha256 hex of the base checkpoint directory (see the module docstring); without one
    (a seeded random base, model.init_from unset) of the seed that drew it."""
    h = hashlib.sha256()
    if not init_from:
        h.update(f"seed:{seed}".encode())
        return h.hexdigest()
    for name in sorted(os.listdir(init_from)):
        path = os.path.join(init_from, name)
        if name in ("config.json", "model.safetensors.index.json"):
            with open(path, "rb") as f:
                h.update(name.encode() + f.read())
        elif name.endswith(".safetensors"):
            h.update(f"{name}:{os.path.getsize(path)}".encode() + _sample(path))
    return h.hexdigest()


def lora_record(cfg: LoraConfig, init_from: Optional[str], seed: int) -> dict[str, Any]:
    """The manifest's "lora" entry of a run: base path and fingerprint, adapter settings."""
    return {"base": os.path.abspath(init_from) if init_from else None,
            "base_fingerprint": base_fingerprint(init_from, seed),
            "rank": cfg.rank, "targets": sorted(cfg.targets)}
