"""Attention with logit soft-capping (Gemma 2): scores = cap · tanh(q kᵀ · scale / cap),
then the mask, a softmax in fp32 and the product with v, as transformers' eager path.

SDPA and the flash kernels have no cap, so this is the explicit form: it keeps the
[seq, seq] probabilities of each head for backward (megaft.perf.counts counts them) and runs
under recompute=selective like the SDPA core. The head's final soft-capping is
`softcap` on the logits."""
from __future__ import annotations

from typing import Optional

import torch


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                      cap: float) -> torch.Tensor:
    """q [b, h, s, d], k/v [b, kv, s, d] (GQA: each kv head serves h/kv query heads); `mask`
    boolean, broadcast to [b, h, s, s] (True = attend), None = causal."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5, cap)
    if mask is None:
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)
