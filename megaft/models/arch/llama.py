"""Llama 2/3.x (LlamaForCausalLM): the reference block. Optional q/k/v/o and MLP biases
(attention_bias, mlp_bias), any head_dim, RoPE scaling (llama3 for 3.1+), tied
embeddings (Llama 3.2 1B/3B)."""
from megaft.models.arch.spec import NO_GEMMA23, ArchSpec, ModelConfig, get, refuse_unless


def _read(raw: dict, file: str) -> dict:
    return dict(attention_bias=bool(get(raw, SPEC, "attention_bias")), mlp_bias=bool(get(raw, SPEC, "mlp_bias")))


def _write(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias}


SPEC = ArchSpec(
    model_type="llama", architecture="LlamaForCausalLM",
    differs="the reference: RMSNorm, SwiGLU, RoPE (default/linear/dynamic/llama3/yarn), GQA, optional biases",
    fields=frozenset(("attention_bias", "mlp_bias")),
    defaults={"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    read=_read, write=_write,
    refuse=lambda cfg: refuse_unless(cfg, SPEC, **NO_GEMMA23, qkv_bias=False, qk_norm=False, sliding_window=None,
                                     activation="silu", norm_offset=0.0, scale_embeddings=False),
)
