"""Rotary position embeddings, in Hugging Face Llama's (rotate-half) convention."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: Optional[dict[str, Any]] = None) -> torch.Tensor:
    """1 / theta^(2i/d), with Llama 3's frequency-dependent scaling when asked."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        inv = _llama3_scale(inv, scaling)
    return inv


def _llama3_scale(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the middle band blended
    # (HF _compute_llama3_parameters).
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [seq_len, head_dim], fp32."""
    pos = torch.arange(seq_len, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))
