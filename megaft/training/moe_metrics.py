"""The router terms of a step (mixture-of-experts models): what each micro-batch adds to the
objective, and the step's metrics (aux_loss, z_loss, tokens per expert per MoE layer).

Objective (megaft.models.moe): the token-weighted cross-entropy of the global batch plus
router_aux_loss_coef x aux + router_z_loss_coef x z averaged over the global batch's
micro-batches (accumulation x dp), as Megatron averages its aux loss; each micro-batch's
value is transformers' for that micro-batch, whatever its split over tp, sp and cp.
"""
from __future__ import annotations

from typing import Optional

from megaft.models.config import ModelConfig
from megaft.models.moe_stats import StepRouterStats, expert_load  # noqa: F401  (the metrics' names)

ROUTER_KEYS = ("aux_loss", "z_loss")  # beside `loss` in metrics.jsonl; per layer: moe/<layer>/...


def moe_record(model: ModelConfig, kernels: dict) -> Optional[dict]:
    """summary.json's `moe`: the experts, the MoE layers, the grouped GEMM's backend (as
    kernels.* decided it) and how tokens reach their experts; None for a dense model."""
    if model.n_experts <= 0:
        return None
    return {"experts": model.n_experts, "top_k": model.top_k,
            "layers": [i for i in range(model.n_layers) if model.is_moe(i)],
            "grouped_gemm": kernels.get("grouped_gemm", {}).get("backend", "torch"),
            "dispatch": "sorted by expert on every tp rank (experts split like the MLP over tp); no token dropped"}
