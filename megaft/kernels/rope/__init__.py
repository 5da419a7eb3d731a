"""Rotary position embedding on q and k (GQA: k may have fewer heads), with a
choice of backend.

    torch   reference.py: torch ops, the specification (= megaft.models.rope.apply_rope)
    triton  triton.py: one program per (batch, position) rotating all q and k heads

``backend="auto"`` takes triton for CUDA tensors when triton imports, else torch
(the CPU path stays torch), and logs that choice once. An explicit backend that
cannot run raises with the reason, never a silent fallback; on CPU, triton runs
only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch

from megaft.kernels import _triton
from megaft.kernels.rope import reference

__all__ = ["BACKENDS", "rope", "resolve_backend"]

BACKENDS = _triton.BACKENDS


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch" or "triton") for tensors on ``device``."""
    return _triton.resolve("rope", backend, device)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         backend: str = "auto", *, inplace: bool = False):
    """(rope(q), rope(k)). q: [batch, heads, seq, head_dim], k: [batch, kv_heads, seq,
    head_dim], head_dim even; cos, sin: [seq, head_dim] as megaft.models.rope.rope_tables
    makes them (sliced to seq). ``inplace=True`` lets the triton backend overwrite q
    and k (their last dim must be contiguous); the torch backend always returns new
    tensors."""
    if resolve_backend(backend, q.device) == "triton":
        return _triton.load("rope").rope(q, k, cos, sin, inplace)
    return reference.rope(q, k, cos, sin)
