"""DeepSeek-V3's auxiliary-loss-free load balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load
Balancing Strategy for Mixture-of-Experts"; DeepSeek-V3 report §2.1.2): after each step, every
MoE layer's routing correction bias moves each expert by a fixed `rate` towards balance,

    bias_e += rate * sign(mean_e' load_e' - load_e),

with load_e the step's top-k assignments to expert e summed over the whole global batch (every
micro-batch, dp×cp replica and, under sequence parallel, tp rank: `metrics`' moe/N/tokens
counts). The bias changes the choice of experts only, never their weights (megaft.models.moe.router.Router),
and no gradient reaches it. `moe.bias_update_rate` = 0 (the fine-tuning default) keeps it frozen.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn


@torch.no_grad()
def update_correction_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Move `bias` [experts] in place by rate * sign(mean(counts) - counts) and return it;
    `counts` [experts]: the layer's assignments over the global batch (the same on every rank,
    so every rank's bias stays identical). An overloaded expert is chosen less next step."""
    if rate:
        counts = counts.to(device=bias.device, dtype=torch.float32)
        bias.add_(rate * torch.sign(counts.mean() - counts).to(bias.dtype))
    return bias


def correction_biases(model: nn.Module) -> dict[int, torch.Tensor]:
    """MoE layer index -> its router's correction bias, for the layers `model` (a Decoder or a
    pipeline stage's part) holds; empty for routers without one."""
    out = {}
    for name, buf in model.named_buffers():
        if name.endswith("mlp.gate.e_score_correction_bias"):
            out[int(name.split("layers.")[1].split(".")[0])] = buf
    return out


def update_correction_biases(model: nn.Module, counts: Mapping[int, torch.Tensor], rate: float) -> None:
    """`update_correction_bias` for every MoE layer of `model`, `counts[layer]` [experts] being that
    layer's assignments summed over the step's global batch."""
    for layer, bias in correction_biases(model).items():
        update_correction_bias(bias, counts[layer], rate)
