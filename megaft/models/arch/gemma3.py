"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text): Gemma's (1 + w) norms,
scaled embeddings, GeGLU and tied embeddings, plus "sandwich" norms (the attention and MLP
outputs are normed before their residual adds: post_attention_layernorm,
pre_feedforward_layernorm, post_feedforward_layernorm), qk-norm, scores scaled by
query_pre_attn_scalar ** -0.5, sliding-window layers (5 of every 6 by default) with their
own RoPE base (rope_local_base_freq / rope_parameters.sliding_attention) and the global
layers' RoPE (possibly scaled); logit soft-capping when config.json sets it (as Gemma 2).
The multimodal Gemma 3 checkpoints (model_type gemma3) are not read by this spec: their text
model is extracted first and merged back after (megaft.models.hf.multimodal); with their
images they are megaft.models.vision's."""
from megaft.models.arch.gemma import SPEC as GEMMA
from megaft.models.arch.spec import ArchSpec, ModelConfig, get, refuse_unless, rope_fields, window_field

WINDOW_FIELDS = ("sliding_window", "layer_types", "sliding_window_pattern", "_sliding_window_pattern")
LOCAL = "rope_local_parameters"  # where `_normalize` puts the sliding layers' rope (read by `_read` only)


def _normalize(raw: dict, file: str) -> dict:
    """transformers 5 writes rope_parameters per layer type; transformers 4 rope_theta /
    rope_scaling for the global layers and rope_local_base_freq for the sliding ones. Both
    become a flat rope_parameters (global) plus LOCAL."""
    out = dict(raw)
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & set(params):
        out["rope_parameters"] = params.get("full_attention") or {"rope_type": "default", "rope_theta": 1e6}
        out[LOCAL] = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": 1e4}
    else:
        out.setdefault("rope_theta", 1e6)
        out[LOCAL] = {"rope_type": "default", "rope_theta": out.pop("rope_local_base_freq", 1e4)}
    return out


def sandwich_read(raw: dict, file: str, spec: ArchSpec, is_global) -> dict:
    """What Gemma 2 and 3 share beyond Gemma 1: sandwich norms, query_pre_attn_scalar, logit
    soft-capping and windowed layers (`layer_types`, or transformers 4's rule `is_global(i)`)."""
    base = GEMMA.read(raw, file)  # norms, embeddings, activation, attention_bias as Gemma 1
    window = window_field(raw, spec)
    types = raw.get("layer_types") or ["full_attention" if is_global(i) else "sliding_attention"
                                       for i in range(raw["num_hidden_layers"])]
    sliding = window is not None and "sliding_attention" in types
    caps = {name: (None if get(raw, spec, key) is None else float(get(raw, spec, key)))
            for name, key in (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping"))}
    return dict(base, sandwich_norms=True, query_pre_attn_scalar=float(get(raw, spec, "query_pre_attn_scalar")),
                sliding_window=window if sliding else None, layer_types=list(types) if sliding else None, **caps)


def sandwich_write(cfg: ModelConfig) -> dict:
    types = [("sliding_attention" if cfg.window(i) is not None else "full_attention") for i in range(cfg.n_layers)]
    qpas = cfg.query_pre_attn_scalar
    qpas = int(qpas) if qpas is not None and float(qpas).is_integer() else qpas  # the HF configs want an int
    return {**GEMMA.write(cfg), "query_pre_attn_scalar": qpas, "sliding_window": cfg.sliding_window,
            "layer_types": types, "final_logit_softcapping": cfg.final_softcap,
            "attn_logit_softcapping": cfg.attn_softcap}


def _read(raw: dict, file: str) -> dict:
    every = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    theta, scaling = rope_fields({"rope_parameters": raw[LOCAL]}, file)
    return dict(sandwich_read(raw, file, SPEC, lambda i: (i + 1) % every == 0), qk_norm=True,
                rope_local={"rope_theta": theta, **(scaling or {})})


def _write(cfg: ModelConfig) -> dict:
    local = dict(cfg.rope_local or {"rope_theta": cfg.rope_theta})
    local.setdefault("rope_type", "default")
    glob = {**(cfg.rope_scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    return {**sandwich_write(cfg),
            "rope_parameters": {"full_attention": glob, "sliding_attention": local},  # transformers 5
            "rope_local_base_freq": local["rope_theta"]}  # transformers 4


SPEC = ArchSpec(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM",
    differs="Gemma's norms, embeddings and GeGLU; sandwich norms, qk-norm, query_pre_attn_scalar, "
            "5:1 sliding/global layers with a local RoPE base",
    fields=frozenset(("attention_bias", "hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping",
                      "attn_logit_softcapping", "rope_local_base_freq", LOCAL) + WINDOW_FIELDS),
    defaults={"hidden_act": "gelu_pytorch_tanh", "head_dim": 256, "attention_bias": False,
              "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
              "sliding_window": 4096, "max_position_embeddings": 131072},
    read=_read, write=_write, normalize=_normalize,
    refuse=lambda cfg: refuse_unless(cfg, SPEC, norm_offset=1.0, scale_embeddings=True, qkv_bias=False,
                                     mlp_bias=False, qk_norm=True, sandwich_norms=True),
)
