"""Expert capacity (`moe.capacity_factor`, megaft.config.moe): which of a micro-batch's
top-k assignments each expert keeps.

Per MoE layer an expert takes at most ceil(factor × tokens × top_k / n_experts) assignments;
the `probs` policy keeps its highest routing weights (ties: the earlier token), `position`
its earliest tokens (batch-major, then slot). Positions that are not tokens of the
micro-batch (the sequence-parallel padding) are never kept and take no capacity.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def capacity(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    return math.ceil(factor * tokens * top_k / n_experts)


def kept_assignments(experts: torch.Tensor, weights: torch.Tensor, n_experts: int, factor: float, policy: str,
                     valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[tokens × top_k] bool: the assignments kept. `experts`, `weights`: [tokens, top_k]
    (row-major token order); `valid`: [tokens] bool, None = every row is a token."""
    flat, w = experts.reshape(-1), weights.reshape(-1)
    k = experts.shape[-1]
    candidates = torch.arange(flat.numel(), device=flat.device)
    if valid is not None:
        candidates = candidates[valid.repeat_interleave(k)]
    cap = capacity(candidates.numel() // k, k, n_experts, factor)
    if policy == "probs":  # highest weight first; a stable sort keeps the earlier token first among equals
        candidates = candidates[torch.argsort(w[candidates], descending=True, stable=True)]
    by_expert = candidates[torch.argsort(flat[candidates], stable=True)]
    counts = torch.bincount(flat[by_expert], minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(by_expert.numel(), device=flat.device) - starts[flat[by_expert]]
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    keep[by_expert[rank < cap]] = True
    return keep
