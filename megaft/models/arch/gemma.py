"""Gemma 1 (GemmaForCausalLM): RMSNorm scaled by (1 + w), input embeddings times
sqrt(hidden_size), GeGLU (gelu_pytorch_tanh; "gelu" means the same, as in transformers),
head_dim 256 by default, tied embeddings by default. (Gemma 2: gemma2.py; Gemma 3 text
models: gemma3.py.)"""
from megaft.models.arch.spec import NO_GEMMA23, ArchSpec, ModelConfig, activation, get, refuse_unless


def _read(raw: dict, file: str) -> dict:
    # transformers 4 read hidden_activation, 5 maps hidden_act "gelu" to the tanh form
    key = "hidden_activation" if raw.get("hidden_activation") else "hidden_act"
    raw = {**raw, key: "gelu_pytorch_tanh" if raw.get(key) == "gelu" else raw.get(key)}
    return dict(norm_offset=1.0, scale_embeddings=True, activation=activation(raw, SPEC, file, key),
                attention_bias=bool(get(raw, SPEC, "attention_bias")))


def _write(cfg: ModelConfig) -> dict:
    return {"attention_bias": cfg.attention_bias, "hidden_activation": cfg.activation}


SPEC = ArchSpec(
    model_type="gemma", architecture="GemmaForCausalLM",
    differs="(1 + w) RMSNorm, embeddings scaled by sqrt(dim), GeGLU (gelu tanh), head_dim 256, tied embeddings",
    fields=frozenset(("attention_bias", "hidden_activation")),
    defaults={"hidden_act": "gelu_pytorch_tanh", "head_dim": 256, "attention_bias": False,
              "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    read=_read, write=_write,
    refuse=lambda cfg: refuse_unless(cfg, SPEC, **NO_GEMMA23, norm_offset=1.0, scale_embeddings=True, qkv_bias=False,
                                     mlp_bias=False, qk_norm=False, sliding_window=None),
)
