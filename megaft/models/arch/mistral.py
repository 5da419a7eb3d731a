"""Mistral (MistralForCausalLM): Llama's block with sliding-window attention on every
layer (`sliding_window`, 4096 when config.json omits it, null = full attention) and
no biases."""
from megaft.models.arch.spec import NO_GEMMA23, ArchSpec, ModelConfig, refuse_unless, window_field


def _read(raw: dict, file: str) -> dict:
    return dict(sliding_window=window_field(raw, SPEC), layer_types=None)


def _write(cfg: ModelConfig) -> dict:
    return {"sliding_window": cfg.sliding_window}


SPEC = ArchSpec(
    model_type="mistral", architecture="MistralForCausalLM",
    differs="sliding-window attention on every layer",
    # attention_bias: MistralAttention hardcodes bias=False, whatever config.json says
    fields=frozenset(("sliding_window", "attention_bias")),
    defaults={"sliding_window": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    read=_read, write=_write,
    refuse=lambda cfg: refuse_unless(cfg, SPEC, **NO_GEMMA23, attention_bias=False, qkv_bias=False, mlp_bias=False,
                                     qk_norm=False, activation="silu", norm_offset=0.0, scale_embeddings=False,
                                     layer_types=None),
)
