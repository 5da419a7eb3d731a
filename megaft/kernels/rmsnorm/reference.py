"""RMSNorm in torch: the specification the other backends are tested against.

Exactly what :class:`megaft.layers.norm.RMSNorm` computes (HF LlamaRMSNorm's order):
normalize in fp32, cast back to ``x.dtype``, then multiply by the weight (so the
output dtype is ``torch.promote_types(x.dtype, weight.dtype)``). Backward is
autograd's.

With ``residual``, the pre-norm block's residual add is fused in front:
``h = x + residual`` (in ``x.dtype``) is normalized and returned too, as
``(rmsnorm(h), h)``.
"""

from __future__ import annotations

import torch


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
            residual: torch.Tensor | None = None):
    """``weight * rmsnorm(x)``; with ``residual``: ``(weight * rmsnorm(x + residual), x + residual)``."""
    if residual is None:
        return _norm(x, weight, eps)
    h = x + residual
    return _norm(h, weight, eps), h
