"""Rotary position embedding on q and k (GQA: k may have fewer heads), with a
choice of backend.

    torch   reference.py: torch ops, the specification (= megaft.models.rope.apply_rope)
    triton  triton.py: one program per (batch, position) rotating all q and k heads

Backend choice: ``megaft.kernels._triton.resolve`` (auto = triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import functools

import torch

from megaft.kernels import _triton
from megaft.kernels.rope import reference

__all__ = ["rope", "resolve_backend"]

# The shared dispatch rule (auto, explicit, errors) with this op's name in messages.
resolve_backend = functools.partial(_triton.resolve, "rope")


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
