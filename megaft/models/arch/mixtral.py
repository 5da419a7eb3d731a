"""Mixtral (MixtralForCausalLM): Mistral's block with a mixture-of-experts MLP on every layer
(num_local_experts experts of intermediate_size, top num_experts_per_tok, weights always
renormalized); published files keep the router and experts in `block_sparse_moe`
(`experts.E.w1/w3/w2` = gate/up/down)."""
from megaft.models.arch.moe_fields import MOE_DEFAULTS, MOE_FIELDS, read_moe, write_moe
from megaft.models.arch.spec import NO_GEMMA23, ArchSpec, ModelConfig, refuse_unless, window_field


def _read(raw: dict, file: str) -> dict:
    return dict(sliding_window=window_field(raw, SPEC), layer_types=None, norm_topk_prob=True,
                **read_moe(raw, SPEC, file, "num_local_experts"))


def _write(cfg: ModelConfig) -> dict:
    return {"sliding_window": cfg.sliding_window, "router_jitter_noise": 0.0,
            **write_moe(cfg, "num_local_experts")}


SPEC = ArchSpec(
    model_type="mixtral", architecture="MixtralForCausalLM",
    differs="mixture-of-experts MLP on every layer (top-k renormalized); optional sliding window",
    fields=frozenset(("sliding_window",) + MOE_FIELDS),
    defaults={**MOE_DEFAULTS, "sliding_window": None, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
              "num_local_experts": 8, "num_experts_per_tok": 2},
    read=_read, write=_write, moe=True,
    refuse=lambda cfg: refuse_unless(
        cfg, SPEC, **NO_GEMMA23, attention_bias=False, qkv_bias=False, mlp_bias=False, qk_norm=False,
        activation="silu", norm_offset=0.0, scale_embeddings=False, layer_types=None, norm_topk_prob=True,
        shared_expert_ffn_dim=0, decoder_sparse_step=1, mlp_only_layers=[], moe_ffn_dim=None),
    moe_module="block_sparse_moe", expert_proj=("w1", "w3", "w2"),
)
