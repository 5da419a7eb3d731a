"""The config.json fields every mixture-of-experts family shares (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE): experts, top-k, the renormalization, the losses' weights; read and written the same way."""
from __future__ import annotations

from typing import Any

from megaft.models.arch.spec import ArchSpec, HFConfigError, ModelConfig, get

# output_router_logits: whether transformers' forward adds the aux loss to `loss`; megaft always
# trains with it (router_aux_loss_coef), so the field changes nothing here and is written false.
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
              "output_router_logits", "router_jitter_noise", "router_z_loss_coef")
EXPERT_KEYS = ("num_experts", "num_local_experts")
MOE_DEFAULTS = {"router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "router_z_loss_coef": 0.0}


def read_moe(raw: dict, spec: ArchSpec, file: str, experts_key: str) -> dict[str, Any]:
    """ModelConfig's expert fields from config.json (`experts_key`: num_local_experts or num_experts;
    the other name is read too: transformers 5 saves Qwen3-MoE's as num_local_experts)."""
    if experts_key not in raw:
        experts_key = next((k for k in EXPERT_KEYS if k in raw), experts_key)
    jitter = get(raw, spec, "router_jitter_noise")
    if jitter:
        raise HFConfigError(f"{file}: router_jitter_noise={jitter} is not supported (random multiplicative noise "
                            "on the router input in training: no run could equal another); fix: a checkpoint with "
                            "router_jitter_noise 0, or model.hf_ignore_keys=[router_jitter_noise] to train without it")
    n_experts = get(raw, spec, experts_key)
    top_k = get(raw, spec, "num_experts_per_tok")
    if not n_experts or not top_k:
        raise HFConfigError(f"{file}: {experts_key}={n_experts} and num_experts_per_tok={top_k} must be >= 1 "
                            f"for a {spec.model_type} model")
    return dict(n_experts=int(n_experts), top_k=int(top_k),
                router_aux_loss_coef=float(get(raw, spec, "router_aux_loss_coef")),
                router_z_loss_coef=float(get(raw, spec, "router_z_loss_coef") or 0.0))


def write_moe(cfg: ModelConfig, experts_key: str) -> dict[str, Any]:
    out = {experts_key: cfg.n_experts, "num_experts_per_tok": cfg.top_k,
           "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}
    if cfg.router_z_loss_coef:  # not a transformers field: kept so megaft reads it back
        out["router_z_loss_coef"] = cfg.router_z_loss_coef
    return out
