"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): Qwen2's block (q/k/v biases) with a
mixture of experts of moe_intermediate_size on every decoder_sparse_step-th layer not in
mlp_only_layers (the others: a dense MLP of intermediate_size), plus a shared expert of
shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate(x)); top-k weights
renormalized only with norm_topk_prob."""
from megaft.models.arch.moe_fields import MOE_DEFAULTS, MOE_FIELDS, read_moe, write_moe
from megaft.models.arch.spec import NO_GEMMA23, ArchSpec, HFConfigError, ModelConfig, get, refuse_unless

FIELDS = ("moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
          "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "use_sliding_window", "sliding_window",
          "max_window_layers", "layer_types")


def _windows(raw: dict, file: str) -> dict:
    """Qwen2MoeConfig's rule: odd-numbered layers (i + 1 odd) below max_window_layers slide when
    use_sliding_window (or transformers 5's layer_types as written)."""
    use = get(raw, SPEC, "use_sliding_window")
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if use and (i + 1) % 2 and i < get(raw, SPEC, "max_window_layers")
                 else "full_attention" for i in range(raw["num_hidden_layers"])]
    if "sliding_attention" not in types:
        return dict(sliding_window=None, layer_types=None)
    window = raw.get("sliding_window")
    if not use or not window:
        raise HFConfigError(f"{file}: layer_types has sliding_attention layers but use_sliding_window is off")
    return dict(sliding_window=int(window), layer_types=list(types))


def _read(raw: dict, file: str) -> dict:
    if not get(raw, SPEC, "qkv_bias"):
        raise HFConfigError(f"{file}: qkv_bias=false is not supported for qwen2_moe (megaft's Qwen2 attention "
                            "has q/k/v biases); fix: a checkpoint with them")
    moe_ffn = get(raw, SPEC, "moe_intermediate_size")
    return dict(qkv_bias=True, moe_ffn_dim=int(moe_ffn), norm_topk_prob=bool(get(raw, SPEC, "norm_topk_prob")),
                shared_expert_ffn_dim=int(get(raw, SPEC, "shared_expert_intermediate_size") or 0),
                decoder_sparse_step=int(get(raw, SPEC, "decoder_sparse_step")),
                mlp_only_layers=list(get(raw, SPEC, "mlp_only_layers") or []),
                **_windows(raw, file), **read_moe(raw, SPEC, file, "num_experts"))


def _write(cfg: ModelConfig) -> dict:
    types = [("sliding_attention" if cfg.window(i) is not None else "full_attention") for i in range(cfg.n_layers)]
    return {"moe_intermediate_size": cfg.expert_ffn, "shared_expert_intermediate_size": cfg.shared_expert_ffn_dim,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers), "qkv_bias": True,
            "use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "layer_types": types, **write_moe(cfg, "num_experts")}


SPEC = ArchSpec(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM",
    differs="q/k/v biases; mixture of experts with a sigmoid-gated shared expert; dense layers by "
            "decoder_sparse_step / mlp_only_layers",
    fields=frozenset(FIELDS + MOE_FIELDS),
    defaults={**MOE_DEFAULTS, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "qkv_bias": True, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    read=_read, write=_write, moe=True,
    refuse=lambda cfg: refuse_unless(
        cfg, SPEC, **NO_GEMMA23, qkv_bias=True, attention_bias=False, mlp_bias=False, qk_norm=False,
        activation="silu", norm_offset=0.0, scale_embeddings=False),
)
