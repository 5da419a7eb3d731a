"""Gemma 2 (Gemma2ForCausalLM): Gemma's (1 + w) norms, scaled embeddings, GeGLU and tied
embeddings, plus the sandwich norms, query_pre_attn_scalar and windowed layers it shares
with Gemma 3 (every other layer slides by default, from the first), one RoPE for all
layers, and logit soft-capping: attention scores cap · tanh(s / cap) (50 by default, the
explicit attention of megaft.models.attention.softcap) and the final logits (30)."""
from megaft.models.arch.gemma3 import WINDOW_FIELDS, sandwich_read, sandwich_write
from megaft.models.arch.spec import ArchSpec, HFConfigError, ModelConfig, refuse_unless, window_field


def _read(raw: dict, file: str) -> dict:
    size, window = raw.get("sliding_window_size"), window_field(raw, SPEC)  # gemma-2-9b writes both names
    if size is not None and size != window:
        raise HFConfigError(f"{file}: sliding_window_size={size} differs from sliding_window={window}; fix: one "
                            "window (transformers reads sliding_window)")
    return sandwich_read(raw, file, SPEC, lambda i: i % 2 == 1)


def _write(cfg: ModelConfig) -> dict:
    return sandwich_write(cfg)


SPEC = ArchSpec(
    model_type="gemma2", architecture="Gemma2ForCausalLM",
    differs="Gemma's norms, embeddings and GeGLU; sandwich norms, query_pre_attn_scalar, alternating "
            "sliding/global layers, attention and final logit soft-capping",
    fields=frozenset(("attention_bias", "hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping",
                      "attn_logit_softcapping", "sliding_window_size") + WINDOW_FIELDS),
    defaults={"hidden_act": "gelu_pytorch_tanh", "head_dim": 256, "attention_bias": False,
              "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
              "sliding_window": 4096, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
              "attn_logit_softcapping": 50.0},
    read=_read, write=_write,
    refuse=lambda cfg: refuse_unless(cfg, SPEC, norm_offset=1.0, scale_embeddings=True, qkv_bias=False,
                                     mlp_bias=False, qk_norm=False, sandwich_norms=True, rope_local=None),
)
