"""Rotary position embedding on q and k (GQA: k may have fewer heads), with a
choice of backend.

    torch   reference.py: torch ops, the specification (= megaft.models.attention.rope.apply_rope)
    triton  triton.py: one program per (batch, position) rotating all q and k heads
    cuda    cuda.py: torch.ops.megaft.rope_fwd (csrc/cuda/rope.cu), out of place

Backend choice: ``megaft.kernels.dispatch.resolve`` (auto = triton, else cuda, on CUDA
tensors; torch on CPU).
"""

from __future__ import annotations

import functools

import torch

from megaft.kernels import _triton, dispatch
from megaft.kernels.rope import cuda, reference

__all__ = ["rope", "resolve_backend"]

# The shared dispatch rule (auto, explicit, errors) with this op's name in messages.
resolve_backend = functools.partial(dispatch.resolve, "rope")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         backend: str = "auto", *, inplace: bool = False):
    """(rope(q), rope(k)). q: [batch, heads, seq, head_dim], k: [batch, kv_heads, seq,
    head_dim], head_dim even; cos, sin: [seq, head_dim] as megaft.models.attention.rope.rope_tables
    makes them (sliced to seq). ``inplace=True`` lets the triton backend overwrite q
    and k (their last dim must be contiguous); the torch and cuda backends always
    return new tensors."""
    choice = resolve_backend(backend, q.device)
    if choice == "triton":
        return _triton.load("rope").rope(q, k, cos, sin, inplace)
    if choice == "cuda":
        return cuda.rope(q, k, cos, sin)
    return reference.rope(q, k, cos, sin)
