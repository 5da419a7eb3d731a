"""`moe.*`: how a mixture of experts routes and balances while training (not the architecture,
which is `model.*`: a checkpoint may resume under other values).

- `capacity_factor`: None drops no token (the default, as transformers computes). A number
  caps each expert, per micro-batch and MoE layer, at ceil(capacity_factor × tokens × top_k /
  n_experts) of the micro-batch's assignments (Switch / GShard capacity); the assignments
  past it are dropped: the token keeps its residual and its other experts, the dropped
  expert's output is left out of the weighted sum. `drop_policy` says which go: `probs`
  keeps each expert's highest routing weights (Megatron's default), `position` the earliest
  tokens (Switch). The decision uses the whole micro-batch on every rank that holds it, so
  it equals the single process's under tp, sequence parallel, pp, dp and ep.
- `aux_scope`: `micro_batch` (transformers: the load-balancing statistics of each
  micro-batch) or `global_batch` (counts summed over the whole global batch, every dp×cp
  replica and accumulation step, before the product: global-batch balancing, Qiu et al.
  2025), see megaft.models.moe.global_router.
- `bias_update_rate`: DeepSeek-V3's auxiliary-loss-free balancing step (megaft.models.moe.balance);
  0 keeps the correction bias as loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional


class DropPolicy(StrEnum):
    probs = "probs"
    position = "position"


class AuxScope(StrEnum):
    micro_batch = "micro_batch"
    global_batch = "global_batch"


@dataclass
class MoEConfig:
    # null: no token dropped; x: each expert takes at most ceil(x * tokens * top_k / n_experts) assignments
    # of a micro-batch per MoE layer, the rest dropped (metrics: moe/<layer>/dropped)
    capacity_factor: Optional[float] = None
    # which assignments past the capacity go: probs (the lowest weights) | position (the latest tokens)
    drop_policy: DropPolicy = DropPolicy.probs
    # load-balancing statistics: micro_batch (transformers) | global_batch (summed over the global batch)
    aux_scope: AuxScope = AuxScope.micro_batch
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step every router's correction bias moves
    # by this * sign(mean load - expert's load) (megaft.models.moe.balance); 0 = frozen (fine-tuning)
    bias_update_rate: float = 0.0


def check_moe(cfg: MoEConfig, *, n_experts: int, cp: int, dropout: float = 0.0,
              correction_bias: Optional[bool] = None) -> list[str]:
    """Every problem of `moe.*` for a model of `n_experts` (0: dense, with `dropout`) at
    context-parallel degree `cp`; `correction_bias`: whether its routers have one (sigmoid
    scoring; None: not known here)."""
    errors = []
    if cfg.bias_update_rate < 0 or cfg.bias_update_rate != cfg.bias_update_rate:
        errors.append(f"moe.bias_update_rate={cfg.bias_update_rate} must be >= 0 (0 keeps the routing correction "
                      "bias frozen); fix: e.g. moe.bias_update_rate=0.001, DeepSeek-V3's pre-training value")
    elif cfg.bias_update_rate > 0 and n_experts > 0 and correction_bias is False:
        errors.append(f"moe.bias_update_rate={cfg.bias_update_rate} moves the routers' correction bias, and this "
                      "model's routers have none (softmax scoring); fix: moe.bias_update_rate=0")

    if cfg.aux_scope == "global_batch" and n_experts > 0 and dropout > 0:
        errors.append(f"moe.aux_scope=global_batch counts the batch's routing in a pass before the step, which "
                      f"routes as training does only without dropout (model.dropout={dropout}); fix: "
                      "model.dropout=0, or moe.aux_scope=micro_batch")
    if cfg.drop_policy not in set(DropPolicy):
        errors.append(f"moe.drop_policy={cfg.drop_policy!r} is unknown; fix: probs or position")
    if cfg.aux_scope not in set(AuxScope):
        errors.append(f"moe.aux_scope={cfg.aux_scope!r} is unknown; fix: micro_batch or global_batch")
    if cfg.capacity_factor is None:
        return errors
    if n_experts == 0:
        errors.append(f"moe.capacity_factor={cfg.capacity_factor} caps the experts of a mixture of experts, and this "
                      "model is dense; fix: moe.capacity_factor=null")
    elif cfg.capacity_factor <= 0:
        errors.append(f"moe.capacity_factor={cfg.capacity_factor} must be > 0 (below 1 an expert cannot take its "
                      "share even under perfect balance); fix: e.g. moe.capacity_factor=1.25, or null to drop "
                      "nothing")
    elif cp > 1:
        errors.append(f"moe.capacity_factor with parallel.cp={cp}: which assignments to drop is decided over the "
                      "whole micro-batch, and each cp rank holds part of its sequences; fix: moe.capacity_factor="
                      "null, or parallel.cp=1")
    return errors
