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
                     valid: Optional[torch.Tensor] = None, tokens: Optional[int] = None) -> torch.Tensor:
    """[tokens × top_k] bool: the assignments kept. `experts`, `weights`: [tokens, top_k]
    (row-major token order); `valid`: [tokens] bool, None = every row is a token; `tokens`:
    how many rows are (the host knows it: no sync to count `valid`). Computed on the device
    without a host sync: a padding row's assignments sort after every expert's and are never kept."""
    flat, w = experts.reshape(-1), weights.reshape(-1)
    k = experts.shape[-1]
    key = flat if valid is None else torch.where(valid.unsqueeze(1).expand(-1, k).reshape(-1), flat, n_experts)
    cap = capacity(experts.shape[0] if tokens is None else tokens, k, n_experts, factor)
    candidates = torch.arange(flat.numel(), device=flat.device)
    if policy == "probs":  # highest weight first; a stable sort keeps the earlier token first among equals
        candidates = torch.argsort(w, descending=True, stable=True)
    by_expert = candidates[torch.argsort(key[candidates], stable=True)]
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    sorted_key = key[by_expert]
    rank = torch.arange(by_expert.numel(), device=flat.device) - starts[sorted_key]
    return torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device).scatter(
        0, by_expert, (rank < cap) & (sorted_key < n_experts))
