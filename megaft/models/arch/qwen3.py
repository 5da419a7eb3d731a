"""Qwen3 (Qwen3ForCausalLM): RMSNorm over head_dim on q and k before RoPE (qk-norm),
head_dim 128 by default (not dim / heads), optional attention_bias and the Qwen2
sliding-window fields."""
from megaft.models.arch.qwen2 import SLIDING_DEFAULTS, SLIDING_FIELDS
from megaft.models.arch.spec import (
    NO_GEMMA23,
    ArchSpec,
    ModelConfig,
    get,
    refuse_unless,
    sliding_layers,
    write_sliding_layers,
)


def _read(raw: dict, file: str) -> dict:
    return dict(qk_norm=True, attention_bias=bool(get(raw, SPEC, "attention_bias")),
                **sliding_layers(raw, SPEC, file))


def _write(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention_bias, **write_sliding_layers(cfg)}


SPEC = ArchSpec(
    model_type="qwen3", architecture="Qwen3ForCausalLM",
    differs="qk-norm (RMSNorm on each q/k head); head_dim set explicitly; optional sliding window",
    fields=frozenset(SLIDING_FIELDS + ("attention_bias",)),
    defaults={**SLIDING_DEFAULTS, "head_dim": 128, "attention_bias": False, "tie_word_embeddings": False,
              "rms_norm_eps": 1e-6},
    read=_read, write=_write,
    refuse=lambda cfg: refuse_unless(cfg, SPEC, **NO_GEMMA23, qk_norm=True, qkv_bias=False, mlp_bias=False,
                                     activation="silu", norm_offset=0.0, scale_embeddings=False),
)
