"""Rotary position embedding in torch: the specification the other backends are
tested against. The formula and rounding of :func:`megaft.models.attention.rope.apply_rope`
(HF Llama's rotate_half convention): ``x * cos + rotate_half(x) * sin`` with cos and
sin cast to ``x.dtype``, applied to q and k (GQA: k may have fewer heads)."""

from __future__ import annotations

import torch


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(rope(q), rope(k)). q: [batch, heads, seq, head_dim], k: [batch, kv_heads,
    seq, head_dim]; cos, sin: [seq, head_dim] (fp32, two equal halves)."""
    return _rope(q, cos, sin), _rope(k, cos, sin)
