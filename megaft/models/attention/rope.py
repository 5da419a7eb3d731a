"""Rotary position embeddings, in Hugging Face Llama's (rotate-half) convention.

`rope_init` computes the inverse frequencies and the cos/sin scale of every rope_type
megaft supports exactly as transformers' ROPE_INIT_FUNCTIONS do
(transformers/modeling_rope_utils.py): default, linear, dynamic (which equals default up
to max_position_embeddings, the longest sequence megaft allows with it, see
check_model), llama3 and yarn. The float ops follow transformers' order so the tables
agree to the last bit on CPU.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch


def rope_kind(scaling: Optional[dict[str, Any]]) -> str:
    s = scaling or {}
    return s.get("rope_type", s.get("type", "default"))


def _default(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_init(head_dim: int, theta: float, scaling: Optional[dict[str, Any]] = None,
              max_position_embeddings: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], attention factor multiplying cos and sin)."""
    kind, s = rope_kind(scaling), scaling or {}
    if kind in ("default", "dynamic"):  # dynamic at seq <= max_position_embeddings: base * 1 (HF init)
        return _default(head_dim, theta), 1.0
    if kind == "linear":
        return _default(head_dim, theta) / s["factor"], 1.0
    if kind == "llama3":
        return _llama3_scale(_default(head_dim, theta), s), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, s, max_position_embeddings)
    raise ValueError(f"rope_type {kind!r} is not supported")


def inv_frequencies(head_dim: int, theta: float, scaling: Optional[dict[str, Any]] = None) -> torch.Tensor:
    """1 / theta^(2i/d), scaled as `scaling` asks (the attention factor aside)."""
    return rope_init(head_dim, theta, scaling)[0]


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: dict[str, Any], max_pos: Optional[int]) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate the long wavelengths, extrapolate the short
    ones, a linear ramp between; cos/sin scaled by the attention factor (HF _compute_yarn_parameters)."""
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor")
    if factor is None:  # DeepSeek-V3 style: the context ratio
        factor = max_pos / old_len
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)) if mscale and mscale_all
                     else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # weight of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention


def rope_tables(inv_freq: torch.Tensor, seq_len: int, attention_factor: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [seq_len, head_dim], fp32 (times YaRN's attention factor)."""
    pos = torch.arange(seq_len, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    if attention_factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))
