"""check_model: the architecture's problems against the tensor-parallel degree, each with its fix
(the families' specs, megaft.models.arch, decide what an HF class can express)."""
from __future__ import annotations

from megaft.config.model import (
    ACTIVATIONS,
    DEEPSEEK_ONLY,
    LAYER_TYPES,
    QK_NORM_WIDTHS,
    ROPE_TYPES,
    ROUTER_SCORING,
    ModelConfig,
    Recompute,
)
from megaft.models.arch import SPECS


def _rope_problems(cfg: ModelConfig) -> list[str]:
    s = dict(cfg.rope_scaling or {})
    kind = s.get("rope_type", s.get("type", "default"))
    if kind not in ROPE_TYPES:
        return [f"model.rope_scaling rope_type {kind!r} is not supported; fix: one of {', '.join(ROPE_TYPES)}"]
    need = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("original_max_position_embeddings",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            }.get(kind, ())
    errors = [f"model.rope_scaling of rope_type {kind} needs {k}" for k in need if k not in s]
    if s.get("partial_rotary_factor", 1.0) != 1.0:
        errors.append(f"model.rope_scaling partial_rotary_factor={s['partial_rotary_factor']} is not supported "
                      "(megaft rotates the whole head); fix: a model with partial_rotary_factor 1")
    max_pos = cfg.extra.get("max_position_embeddings", cfg.max_seq_len)
    if kind == "dynamic" and cfg.max_seq_len > max_pos:
        # transformers recomputes dynamic-NTK frequencies from each batch's length past
        # max_position_embeddings: no fixed table equals it there.
        errors.append(f"model.max_seq_len={cfg.max_seq_len} exceeds max_position_embeddings={max_pos} under "
                      "dynamic rope scaling, where transformers rescales by each batch's length (a fixed rotary "
                      f"table cannot match); fix: model.max_seq_len <= {max_pos}")
    return errors


def _variant_problems(cfg: ModelConfig) -> list[str]:
    errors = []
    if cfg.activation not in ACTIVATIONS:
        errors.append(f"model.activation={cfg.activation!r} is not supported; fix: one of {', '.join(ACTIVATIONS)}")
    if cfg.sliding_window is not None and cfg.sliding_window < 1:
        errors.append(f"model.sliding_window={cfg.sliding_window} must be >= 1 (or null for full attention)")
    if cfg.layer_types is not None:
        if len(cfg.layer_types) != cfg.n_layers:
            errors.append(f"model.layer_types has {len(cfg.layer_types)} entries for model.n_layers={cfg.n_layers}")
        bad = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
        if bad:
            errors.append(f"model.layer_types {bad} not supported; fix: entries among {', '.join(LAYER_TYPES)}")
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar <= 0:
        errors.append(f"model.query_pre_attn_scalar={cfg.query_pre_attn_scalar} must be > 0 (or null: head_dim)")
    for name in ("attn_softcap", "final_softcap"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            errors.append(f"model.{name}={getattr(cfg, name)} must be > 0 (or null: no soft-capping)")
    if cfg.rope_local is not None and "rope_theta" not in cfg.rope_local:
        errors.append("model.rope_local needs rope_theta; fix: e.g. model.rope_local={rope_theta: 10000.0}")
    errors += _moe_problems(cfg) + _mla_problems(cfg)
    if cfg.arch not in SPECS:
        errors.append(f"model.arch={cfg.arch!r} is not supported; fix: one of {', '.join(SPECS)}")
    else:  # what the family's HF class fixes: a model it cannot express would export wrong
        spec = SPECS[cfg.arch]
        if spec.moe != (cfg.n_experts > 0):
            moe = ", ".join(name for name, s in SPECS.items() if s.moe)
            errors.append(f"model.n_experts={cfg.n_experts} cannot be exported as {cfg.arch} ({spec.architecture} "
                          + ("is a mixture of experts); fix: model.n_experts >= 1" if spec.moe else
                             f"has dense MLPs); fix: model.arch among the mixtures of experts ({moe})"))
        errors += [p + "; fix: set model.arch to a family that has it" for p in spec.refuse(cfg)]
        if cfg.arch != "deepseek_v3":  # what only DeepSeek-V3's HF class expresses
            errors += [f"model.{k}={getattr(cfg, k)!r} cannot be exported as {cfg.arch}; fix: model.arch=deepseek_v3 "
                       f"or model.{k}={v!r}" for k, v in DEEPSEEK_ONLY.items() if getattr(cfg, k) != v]
    return errors


def _moe_problems(cfg: ModelConfig) -> list[str]:
    if cfg.qk_norm_width not in QK_NORM_WIDTHS:
        return [f"model.qk_norm_width={cfg.qk_norm_width!r} is unknown; fix: one of {', '.join(QK_NORM_WIDTHS)}"]
    if cfg.n_experts == 0:
        return []
    errors = []
    if cfg.n_experts < 0:
        errors.append(f"model.n_experts={cfg.n_experts} must be >= 0 (0 = dense MLPs)")
    elif not 1 <= cfg.top_k <= cfg.n_experts:
        errors.append(f"model.top_k={cfg.top_k} must be between 1 and model.n_experts={cfg.n_experts}; "
                      f"fix: model.top_k <= {cfg.n_experts}")
    for name in ("moe_ffn_dim", "shared_expert_ffn_dim"):
        value = getattr(cfg, name)
        if value is not None and value < (1 if name == "moe_ffn_dim" else 0):
            errors.append(f"model.{name}={value} must be >= 1" + (" (or null: ffn_dim)" if name == "moe_ffn_dim"
                                                                    else " (0: no shared expert)"))
    if cfg.decoder_sparse_step < 1:
        errors.append(f"model.decoder_sparse_step={cfg.decoder_sparse_step} must be >= 1")
    bad = sorted(i for i in cfg.mlp_only_layers if not 0 <= i < cfg.n_layers)
    if bad:
        errors.append(f"model.mlp_only_layers {bad} are not layers of a {cfg.n_layers}-layer model")
    if not any(cfg.is_moe(i) for i in range(cfg.n_layers)):
        errors.append("model.n_experts > 0 but no layer is a mixture of experts (decoder_sparse_step / "
                      "mlp_only_layers leave none); fix: model.n_experts=0 for a dense model")
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
        if getattr(cfg, name) < 0:
            errors.append(f"model.{name}={getattr(cfg, name)} must be >= 0")
    return errors + _routing_problems(cfg)


def _routing_problems(cfg: ModelConfig) -> list[str]:
    errors = []
    if cfg.router_scoring not in ROUTER_SCORING:
        errors.append(f"model.router_scoring={cfg.router_scoring!r} is unknown; fix: one of "
                      f"{', '.join(ROUTER_SCORING)}")
    if cfg.n_group < 1 or cfg.n_experts % cfg.n_group:
        errors.append(f"model.n_group={cfg.n_group} must be >= 1 and divide model.n_experts={cfg.n_experts}")
    elif cfg.n_group > 1 and cfg.n_experts // cfg.n_group < 2:
        errors.append(f"model.n_group={cfg.n_group} leaves fewer than 2 experts per group (a group scores by its "
                      "2 best experts, as DeepSeek-V3); fix: fewer groups")
    elif not 1 <= cfg.topk_group <= cfg.n_group:
        errors.append(f"model.topk_group={cfg.topk_group} must be between 1 and model.n_group={cfg.n_group}")
    elif cfg.top_k > cfg.topk_group * (cfg.n_experts // cfg.n_group):
        errors.append(f"model.top_k={cfg.top_k} exceeds the experts of model.topk_group={cfg.topk_group} groups; "
                      "fix: a larger topk_group")
    if cfg.routed_scaling_factor <= 0:
        errors.append(f"model.routed_scaling_factor={cfg.routed_scaling_factor} must be > 0")
    if cfg.router_scoring == "sigmoid" and cfg.router_aux_loss_coef > 0:
        # the Switch loss over unnormalised sigmoid scores is neither transformers' loss nor
        # DeepSeek-V3's sequence-wise one; DeepSeek balances with its correction bias instead
        errors.append(f"model.router_scoring=sigmoid with model.router_aux_loss_coef={cfg.router_aux_loss_coef}: "
                      "the load-balancing loss is defined for softmax scores only; fix: "
                      "model.router_aux_loss_coef=0 (DeepSeek-V3 balances aux-loss-free with its correction bias, "
                      "as the importer sets) or model.router_scoring=softmax")
    return errors


def _mla_problems(cfg: ModelConfig) -> list[str]:
    """Multi-head latent attention's sizes (megaft.models.attention.mla)."""
    if cfg.kv_lora_rank == 0:
        return []
    errors = [f"model.{name}={getattr(cfg, name)} must be >= 1 under multi-head latent attention"
              for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim") if getattr(cfg, name) < 1]
    if cfg.q_lora_rank is not None and cfg.q_lora_rank < 1:
        errors.append(f"model.q_lora_rank={cfg.q_lora_rank} must be >= 1 (or null: one q_proj)")
    if cfg.kv_heads != cfg.n_heads:
        errors.append(f"model.n_kv_heads={cfg.kv_heads} must equal model.n_heads={cfg.n_heads} under multi-head "
                      "latent attention (every head has its own keys from the latent); fix: model.n_kv_heads=null")
    for name in ("qk_norm", "attention_bias", "qkv_bias", "sliding_window", "attn_softcap", "query_pre_attn_scalar"):
        if getattr(cfg, name) not in (False, None):
            errors.append(f"model.{name}={getattr(cfg, name)!r} is not supported with multi-head latent attention; "
                          f"fix: model.{name}={'false' if isinstance(getattr(cfg, name), bool) else 'null'}")
    return errors


def check_model(cfg: ModelConfig, tp: int) -> list[str]:
    """Every problem of the architecture against the tensor-parallel degree, with its fix."""
    errors = []
    for name in ("dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
        if getattr(cfg, name) < 1:
            errors.append(f"model.{name}={getattr(cfg, name)} must be >= 1")
    if errors:
        return errors
    if cfg.n_heads % cfg.kv_heads:
        errors.append(f"model.n_heads={cfg.n_heads} is not a multiple of model.n_kv_heads={cfg.kv_heads}; "
                      "fix: choose n_kv_heads dividing n_heads")
    if cfg.head_dim is None and cfg.dim % cfg.n_heads:
        errors.append(f"model.dim={cfg.dim} is not divisible by model.n_heads={cfg.n_heads}; fix: set model.head_dim")
    if cfg.hd % 2:
        errors.append(f"head dim {cfg.hd} must be even for rotary embeddings; fix: change model.dim/n_heads/head_dim")
    if tp > 0:
        sizes = [("n_heads", cfg.n_heads), ("ffn_dim", cfg.ffn_dim)]
        if cfg.n_experts > 0:
            sizes += [("moe_ffn_dim" if cfg.moe_ffn_dim else "ffn_dim (each expert's)", cfg.expert_ffn)]
            sizes += [("shared_expert_ffn_dim", cfg.shared_expert_ffn_dim)] if cfg.shared_expert_ffn_dim else []
        for name, value in sizes:
            if value % tp:
                errors.append(f"parallel.tp={tp} does not divide model.{name}={value}; "
                              f"fix: pick tp among the divisors of {value}")
        # tp wider than the kv heads replicates them (kv_replicas), which needs whole
        # copies: tp a multiple of n_kv_heads; narrower tp splits them evenly.
        if cfg.kv_heads % tp and tp % cfg.kv_heads:
            errors.append(f"parallel.tp={tp} neither divides nor is a multiple of model.n_kv_heads={cfg.kv_heads}; "
                          f"fix: a divisor or a multiple of {cfg.kv_heads}")
    if tp > cfg.kv_heads and cfg.qk_norm and cfg.qk_norm_width == "full":
        errors.append(f"parallel.tp={tp} exceeds model.n_kv_heads={cfg.kv_heads} with a full-width qk-norm "
                      "(OLMoE): replicated kv heads would count twice in k's norm; fix: parallel.tp <= "
                      f"{cfg.kv_heads}")
    quant = cfg.extra.get("quantization_config")
    if cfg.init_from and quant:
        errors.append(f"model.init_from={cfg.init_from} holds quantized weights (quantization_config quant_method="
                      f"{quant.get('quant_method')!r}), which megaft cannot train; its config.json is readable for "
                      "planning only; fix: dequantize the checkpoint to bf16 first (for DeepSeek-V3/R1's FP8 "
                      "blocks, DeepSeek's inference/fp8_cast_bf16.py) and point model.init_from at that copy")
    if not 0.0 <= cfg.dropout < 1.0:
        errors.append(f"model.dropout={cfg.dropout} must be in [0, 1)")
    if cfg.recompute not in set(Recompute):  # a config built in Python
        errors.append(f"model.recompute={cfg.recompute!r} is unknown; fix: none, selective or full")
    if cfg.recompute_layers is not None and cfg.recompute_layers < 0:
        errors.append(f"model.recompute_layers={cfg.recompute_layers} must be >= 0; fix: a count of blocks per "
                      "pipeline stage, or null for all")
    return errors + _rope_problems(cfg) + _variant_problems(cfg)
