"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): biases on q/k/v (none on o or the MLP), and an
optional sliding window on layers >= max_window_layers (use_sliding_window, or
transformers 5's layer_types)."""
from megaft.models.arch.spec import (
    NO_GEMMA23,
    ArchSpec,
    ModelConfig,
    refuse_unless,
    sliding_layers,
    write_sliding_layers,
)

SLIDING_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
SLIDING_DEFAULTS = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}


def _read(raw: dict, file: str) -> dict:
    return dict(qkv_bias=True, **sliding_layers(raw, SPEC, file))


def _write(cfg: ModelConfig) -> dict:
    return write_sliding_layers(cfg)


SPEC = ArchSpec(
    model_type="qwen2", architecture="Qwen2ForCausalLM",
    differs="q/k/v biases; optional sliding window on the upper layers",
    # attention_bias: Qwen2Attention hardcodes q/k/v bias=True, o bias=False, whatever config.json says
    fields=frozenset(SLIDING_FIELDS + ("attention_bias",)),
    defaults={**SLIDING_DEFAULTS, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    read=_read, write=_write,
    refuse=lambda cfg: refuse_unless(cfg, SPEC, **NO_GEMMA23, qkv_bias=True, attention_bias=False, mlp_bias=False,
                                     qk_norm=False, activation="silu", norm_offset=0.0, scale_embeddings=False),
)
