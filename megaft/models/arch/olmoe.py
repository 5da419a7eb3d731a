"""OLMoE (OlmoeForCausalLM): Llama's attention with an RMSNorm over the whole q (and k)
projection, all heads at once (qk_norm_width=full), before RoPE; a mixture of experts of
intermediate_size on every layer, top-k weights not renormalized (norm_topk_prob false in
the published models); clip_qkv must be null."""
from megaft.models.arch.moe_fields import MOE_DEFAULTS, MOE_FIELDS, read_moe, write_moe
from megaft.models.arch.spec import NO_GEMMA23, ArchSpec, HFConfigError, ModelConfig, get, refuse_unless


def _read(raw: dict, file: str) -> dict:
    if raw.get("clip_qkv") is not None:
        raise HFConfigError(f"{file}: clip_qkv={raw['clip_qkv']} is not supported (q/k/v clamped in place: "
                            "megaft does not clamp); fix: a checkpoint with clip_qkv null")
    return dict(qk_norm=True, qk_norm_width="full", attention_bias=bool(get(raw, SPEC, "attention_bias")),
                norm_topk_prob=bool(get(raw, SPEC, "norm_topk_prob")), **read_moe(raw, SPEC, file, "num_experts"))


def _write(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention_bias, "norm_topk_prob": cfg.norm_topk_prob, "clip_qkv": None,
            **write_moe(cfg, "num_experts")}


SPEC = ArchSpec(
    model_type="olmoe", architecture="OlmoeForCausalLM",
    differs="RMSNorm over the whole q and k projections; mixture of experts on every layer (top-k not "
            "renormalized by default)",
    fields=frozenset(("norm_topk_prob", "attention_bias", "clip_qkv") + MOE_FIELDS),
    defaults={**MOE_DEFAULTS, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
              "attention_bias": False, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
              "rms_norm_eps": 1e-5},
    read=_read, write=_write, moe=True,
    refuse=lambda cfg: refuse_unless(
        cfg, SPEC, **NO_GEMMA23, qk_norm=True, qk_norm_width="full", qkv_bias=False, mlp_bias=False,
        activation="silu", norm_offset=0.0, scale_embeddings=False, sliding_window=None, layer_types=None,
        shared_expert_ffn_dim=0, decoder_sparse_step=1, mlp_only_layers=[], moe_ffn_dim=None),
)
