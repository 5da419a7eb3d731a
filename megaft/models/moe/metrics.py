"""The router terms of a step (mixture-of-experts models): what each micro-batch adds to the
objective, and the step's metrics (aux_loss, z_loss, tokens per expert per MoE layer).

Objective (megaft.models.moe): the token-weighted cross-entropy of the global batch plus
router_aux_loss_coef x aux + router_z_loss_coef x z averaged over the global batch's
micro-batches (accumulation x dp), as Megatron averages its aux loss; each micro-batch's
value is transformers' for that micro-batch, whatever its split over tp, sp and cp. Under
moe.aux_scope=global_batch, aux and z are the global batch's (megaft.models.moe.global_router).
"""
from __future__ import annotations

from typing import Optional

from megaft.config.model import ModelConfig
from megaft.config.moe import MoEConfig

ROUTER_KEYS = ("aux_loss", "z_loss")  # beside `loss` in metrics.jsonl; per layer: moe/<layer>/...


def router_weight(n_targets: int, micro_batches: int, dp_size: int, routing: Optional[MoEConfig] = None) -> float:
    """The router terms' weight per micro-batch (`micro_batches`: this rank's), in token-loss
    units: the step divides by n_targets, so this averages them over the global batch's micro-batches.
    Under moe.aux_scope=global_batch the micro-batches' terms are shares of one global value: weight 1."""
    if routing is not None and routing.aux_scope == "global_batch":
        return float(n_targets)
    return n_targets / (micro_batches * dp_size)


def moe_record(model: ModelConfig, kernels: dict, *, ep: int = 1,
               routing: Optional[MoEConfig] = None) -> Optional[dict]:
    """summary.json's `moe`: the experts, the MoE layers, the grouped GEMM's backend (as
    kernels.* decided it), how tokens reach their experts, and what is dropped; None for a dense model."""
    if model.n_experts <= 0:
        return None
    routing = routing or MoEConfig()
    where = ("sorted by expert on every tp rank (experts split like the MLP over tp)" if ep == 1 else
             f"all-to-all over ep={ep} (each ep rank holds {model.n_experts // ep} experts, each split like the "
             "MLP over tp)")
    drops = ("no token dropped" if routing.capacity_factor is None else
             f"capacity factor {routing.capacity_factor}, drop policy {routing.drop_policy}")
    return {"experts": model.n_experts, "top_k": model.top_k,
            "layers": [i for i in range(model.n_layers) if model.is_moe(i)],
            "grouped_gemm": kernels.get("grouped_gemm", {}).get("backend", "torch"),
            "dispatch": f"{where}; {drops}", "aux_scope": str(routing.aux_scope)}
