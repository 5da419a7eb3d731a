"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's block (qk-norm over each head, head_dim set
explicitly) with a mixture of experts of moe_intermediate_size on every
decoder_sparse_step-th layer not in mlp_only_layers; no shared expert; top-k weights
renormalized with norm_topk_prob (true in the published models)."""
from megaft.models.arch.moe_fields import MOE_DEFAULTS, MOE_FIELDS, read_moe, write_moe
from megaft.models.arch.spec import NO_GEMMA23, ArchSpec, HFConfigError, ModelConfig, get, refuse_unless

# Written by some Qwen releases (Qwen3-Coder-30B-A3B-Instruct) though Qwen3MoeForCausalLM reads none of
# them: accepted at the values that describe its block (no q/k/v bias, qk-norm, no shared expert).
UNREAD = {"qkv_bias": (False, None), "use_qk_norm": (True, None), "shared_expert_intermediate_size": (0, None)}
FIELDS = tuple(UNREAD) + ("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
          "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers")


def _read(raw: dict, file: str) -> dict:
    for key, ok in UNREAD.items():
        if raw.get(key) not in ok:
            raise HFConfigError(f"{file}: {key}={raw[key]!r} does not describe a Qwen3-MoE block (its attention has "
                                "no q/k/v bias and a qk-norm, and it has no shared expert); fix: model_type qwen2_moe "
                                f"for a model with them, or model.hf_ignore_keys=[{key}] if it has no effect")
    # every layer slides when use_sliding_window (Qwen3MoeConfig keeps one window for all)
    window = raw.get("sliding_window") if get(raw, SPEC, "use_sliding_window") else None
    return dict(qk_norm=True, attention_bias=bool(get(raw, SPEC, "attention_bias")),
                sliding_window=None if window is None else int(window), layer_types=None,
                moe_ffn_dim=int(get(raw, SPEC, "moe_intermediate_size")),
                norm_topk_prob=bool(get(raw, SPEC, "norm_topk_prob")),
                decoder_sparse_step=int(get(raw, SPEC, "decoder_sparse_step")),
                mlp_only_layers=list(get(raw, SPEC, "mlp_only_layers") or []),
                **read_moe(raw, SPEC, file, "num_experts"))


def _write(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention_bias, "moe_intermediate_size": cfg.expert_ffn,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers), "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window, **write_moe(cfg, "num_experts")}


SPEC = ArchSpec(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    differs="qk-norm; mixture of experts (top-k renormalized with norm_topk_prob); dense layers by "
            "decoder_sparse_step / mlp_only_layers",
    fields=frozenset(FIELDS + MOE_FIELDS),
    defaults={**MOE_DEFAULTS, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
              "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "head_dim": 128,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    read=_read, write=_write, moe=True,
    refuse=lambda cfg: refuse_unless(
        cfg, SPEC, **NO_GEMMA23, qk_norm=True, qk_norm_width="head", qkv_bias=False, mlp_bias=False,
        activation="silu", norm_offset=0.0, scale_embeddings=False, layer_types=None, shared_expert_ffn_dim=0),
)
