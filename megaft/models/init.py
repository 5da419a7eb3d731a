"""Deterministic initialization that does not depend on the tensor-parallel degree.

Every parameter's FULL tensor is drawn from a generator seeded by (seed, name) and
each rank keeps its shard, so tp=1, 2, 4 start from the same model (what the
parallel-equivalence tests and users comparing configs need).
"""
from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from megaft.config.model import ModelConfig
from megaft.parallel.tensor.shard import full_shape, local_from_full

# Output projections of each residual branch get std / sqrt(2 * n_layers) (GPT-2, Megatron).
_SCALED = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_params(model: nn.Module, cfg: ModelConfig, *, seed: int, tp_rank: int, tp_size: int) -> None:
    for name, param in model.named_parameters():
        shape = full_shape(param, tp_size)
        if name.endswith("norm.weight"):  # a unit scale: w = 1, or 0 where the norm adds 1 (Gemma)
            full = torch.full(shape, 1.0 - cfg.norm_offset)
        elif name.endswith(".bias"):
            full = torch.zeros(shape)
        else:
            std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(_SCALED) else cfg.init_std
            gen = torch.Generator().manual_seed(_seed_for(seed, name))
            full = torch.randn(shape, generator=gen) * std
        param.copy_(local_from_full(full, param, tp_rank, tp_size).to(param.device))


@torch.no_grad()
def init_score(model: nn.Module, cfg: ModelConfig, *, seed: int) -> None:
    """A reward model's new scalar head (`score.weight`, [1, dim], whole on every rank) drawn as
    transformers' _init_weights draws a *ForSequenceClassification's: normal(0, initializer_range),
    here from the generator of (seed, name), so every layout starts from the same head."""
    score = getattr(model, "score", None)
    if score is None:  # a pipeline stage before the last
        return
    gen = torch.Generator().manual_seed(_seed_for(seed, "score.weight"))
    score.weight.copy_((torch.randn(tuple(score.weight.shape), generator=gen) * cfg.init_std).to(score.weight))
