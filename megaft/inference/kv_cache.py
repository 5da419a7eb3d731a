"""The keys and values of the tokens decoded so far, so that each new token runs one position
through the model (megaft.inference.generate).

`kv_cache(model)` gives every `Attention` and `MLAttention` of `model` (a `Decoder`, or a pipeline
rank's `StageModel`: each rank caches its own layers) a `LayerCache` over one shared
`DecodeState`; outside the block the model is the training model again. The cache holds this
tp rank's heads after RoPE (kv heads as the rank computes them, replicated ones included),
[batch, kv_heads / tp, cached, head_dim], written in place into buffers sized at the prompt
(`capacity`: prompt length + new tokens), so each new token is copied once. Under sequence
parallel the model right-pads a forward's tokens to a multiple of tp: `DecodeState.real` tells
the layers how many of them are real, and only those enter the cache (a padded query's output
is cropped by the caller).

Every attention kind megaft builds caches. A sliding-window layer caches every position and
lets each query see its last `window` of them (the cache is not trimmed); a latent attention
layer (MLA) caches its heads' expanded keys and values (not the compressed latent: simpler,
more memory); soft-capped scores (Gemma 2) are computed as in training over the cached keys.
Context parallelism needs nothing: generation runs the whole sequence on every cp rank (no ring).

Prompts of different lengths decode in one batch left-padded (`DecodeState.pad`: each row's pad
count), as transformers' generate does with an attention_mask: a row's RoPE positions start at 0 at
its first real token (position_ids from the mask's cumsum), and no query sees a pad slot of the
cache but a pad query sees itself (its output is never read; a query that sees nothing would give
NaN, and 0 x NaN in a later layer's values would reach the real rows). The pad slots stay in the
cache, masked. M-RoPE's offset (a prompt with images) is per batch: with padding it is refused.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from megaft.models.attention.gqa import Attention
from megaft.models.attention.mla import MLAttention
from megaft.models.attention.softcap import softcap_attention


@dataclass
class DecodeState:
    """Shared by a model's layers: `pos` tokens are cached; the forward in hand brings `real` new ones.
    `rope_offset`: added to the new tokens' RoPE positions (M-RoPE: a prompt's images take fewer
    positions than tokens, so the text after them sits at index + offset; Qwen2.5-VL's prefill sets it)."""

    pos: int = 0
    real: int = 0
    rope_offset: int = 0
    pad: Optional[torch.Tensor] = None  # [batch] each row's left padding (long); None: no row padded

    def advance(self) -> None:
        """After a forward: its real tokens are cached."""
        self.pos += self.real


class LayerCache:
    """One attention layer's keys and values so far: written in place into buffers
    [batch, kv_heads, capacity, head_dim] allocated at the first forward (the prompt), so a new
    token copies only itself; `extend` returns views of the filled part. Without a capacity, or
    past it, the buffers grow by doubling (a copy per doubling, not per token)."""

    def __init__(self, state: DecodeState, capacity: Optional[int] = None):
        self.state = state
        self.capacity = capacity  # positions to hold: prompt + new tokens; None = grow as needed
        self.filled = 0
        self.k_buf: Optional[torch.Tensor] = None
        self.v_buf: Optional[torch.Tensor] = None

    def _reserve(self, k: torch.Tensor, v: torch.Tensor, need: int) -> None:
        """Buffers of at least `need` positions, shaped and typed like k, v, holding what is cached."""
        if self.k_buf is not None and self.k_buf.shape[2] >= need:
            return
        size = max(need, self.capacity or 0, 2 * (self.k_buf.shape[2] if self.k_buf is not None else 0))
        k_buf = k.new_empty(*k.shape[:2], size, k.shape[3])
        v_buf = v.new_empty(*v.shape[:2], size, v.shape[3])
        if self.filled:
            k_buf[:, :, :self.filled] = self.k_buf[:, :, :self.filled]
            v_buf[:, :, :self.filled] = self.v_buf[:, :, :self.filled]
        self.k_buf, self.v_buf = k_buf, v_buf

    @property
    def k(self) -> Optional[torch.Tensor]:
        """The cached keys [batch, kv_heads, cached, head_dim] (a view); None before the first forward."""
        return None if self.k_buf is None else self.k_buf[:, :, :self.filled]

    @property
    def v(self) -> Optional[torch.Tensor]:
        """The cached values, as `k`."""
        return None if self.v_buf is None else self.v_buf[:, :, :self.filled]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the real positions of k, v [batch, kv_heads, seq, head_dim]; the whole cache."""
        real = self.state.real
        end = self.filled + real
        self._reserve(k, v, end)
        self.k_buf[:, :, self.filled:end] = k[:, :, :real]
        self.v_buf[:, :, self.filled:end] = v[:, :, :real]
        self.filled = end
        return self.k, self.v

    def positions(self, seq: int, table_len: int, device: torch.device) -> torch.Tensor:
        """The RoPE positions of a forward's `seq` tokens (padding clamped into the table): [seq], or
        [batch, seq] when rows are left-padded (each row's first real token at 0, its pads at 0)."""
        first = self.state.pos + self.state.rope_offset
        at = torch.arange(first, first + seq, device=device)
        if self.state.pad is None:
            return at.clamp(max=table_len - 1)
        if self.state.rope_offset:
            raise ValueError("left-padded rows with an M-RoPE offset (a prompt with images): decode such "
                             "prompts one at a time (megaft.inference.vision)")
        return (at.unsqueeze(0) - self.state.pad.to(device).unsqueeze(1)).clamp(0, table_len - 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool,
               window: Optional[int] = None, scale: Optional[float] = None,
               softcap: Optional[float] = None) -> torch.Tensor:
        """Causal attention of the new queries q [batch, heads, seq, head_dim] (already rotated
        and scaled) over the cache extended by the new k, v; `window`: a sliding-window layer's
        (each query sees its last `window` positions, itself included, as in training); `scale`:
        SDPA's (latent attention's own; None: head_dim^-1/2); `softcap`: soft-capped scores
        (Gemma 2), computed as training computes them (megaft.models.attention.softcap)."""
        pos, s = self.state.pos, q.shape[2]
        k, v = self.extend(k, v)
        n = k.shape[2]
        if window is not None and window >= pos + s:  # the window reaches back to the first token
            window = None
        if self.state.pad is not None:  # left-padded rows: the pad slots masked, row by row
            mask = _padded_mask(pos, s, n, window, self.state.pad.to(q.device))
            if softcap is not None:
                return softcap_attention(q, k, v, mask, softcap)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
        if softcap is not None:
            return softcap_attention(q, k, v, _mask(pos, s, n, window, q.device), softcap)
        if window is None and pos == 0 and s == n:  # the prompt: exactly the training forward's attention
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
        if window is None and s == 1:  # one new token sees every cached one
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(pos, s, n, window, q.device), enable_gqa=gqa,
                                              scale=scale)


def _mask(pos: int, s: int, n: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """[s, n] True where query pos + i may see cached position j: causal, within `window`."""
    i = torch.arange(s, device=device).unsqueeze(1) + pos
    j = torch.arange(n, device=device).unsqueeze(0)
    return (j <= i) if window is None else (j <= i) & (j > i - window)


def _padded_mask(pos: int, s: int, n: int, window: Optional[int], pad: torch.Tensor) -> torch.Tensor:
    """[batch, 1, s, n]: `_mask` without each row's first pad[row] slots, every query seeing itself
    (a pad query sees only itself: finite, and never read)."""
    i = torch.arange(s, device=pad.device).unsqueeze(1) + pos
    j = torch.arange(n, device=pad.device).unsqueeze(0)
    real = j.unsqueeze(0) >= pad.view(-1, 1, 1)  # [batch, 1, n]
    return ((_mask(pos, s, n, window, pad.device).unsqueeze(0) & real) | (j == i)).unsqueeze(1)


@contextlib.contextmanager
def kv_cache(model: torch.nn.Module, capacity: Optional[int] = None) -> Iterator[DecodeState]:
    """Cache keys and values in every attention layer of `model` while the block runs; `capacity`
    (the prompt's length plus the new tokens) sizes each layer's buffers at the prompt."""
    state = DecodeState()
    layers = [m for m in model.modules() if isinstance(m, (Attention, MLAttention))]
    for layer in layers:
        layer.cache = LayerCache(state, capacity)
    try:
        yield state
    finally:
        for layer in layers:
            layer.cache = None
