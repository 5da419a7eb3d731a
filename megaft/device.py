"""`device=auto|cpu|cuda`: the one place that decides where a run computes.

`auto` means CUDA when this process's torch sees a GPU, else the CPU. Every reader of
the setting asks `resolve_device`: validation (kernel and fused-optimizer checks, the
memory budget), megaft-commbench's checks and each rank's device (megaft.launch.rank).
An explicit `cuda` stays `cuda` without a GPU; the checks and the rank say so then.
"""
from __future__ import annotations

from typing import Optional


def resolve_device(setting: Optional[str]) -> str:
    """"cuda" or "cpu" for `device=setting` (None is auto)."""
    if setting == "cuda":
        return "cuda"
    if setting in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"
