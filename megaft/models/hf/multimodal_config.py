"""The text config of a multimodal checkpoint's config.json (Gemma 3: model_type gemma3), made complete
with transformers' text-config defaults. Apart from megaft.models.hf.multimodal (which reads and writes
tensors) so that reading a config imports no torch: megaft-plan reads vision-language configs too."""
from __future__ import annotations

from megaft.models.arch.spec import HFCheckpointError

# multimodal model_type -> (text model_type, text architecture)
MULTIMODAL = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
# The published multimodal configs list in text_config only what differs from the text config
# class's defaults; these are transformers' Gemma3TextConfig defaults (4.50 and later), written
# into the extracted config.json so that it is complete on its own.
TEXT_DEFAULTS = {"gemma3": {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "rope_scaling": None, "rope_local_base_freq": 10000.0,
    "sliding_window_pattern": 6, "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}}
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # the multimodal config's ids win over the defaults


def text_config(raw: dict, file: str) -> dict:
    kind = raw.get("model_type")
    if kind not in MULTIMODAL:
        raise HFCheckpointError(f"{file}: model_type {kind!r} is not a multimodal checkpoint megaft can take the "
                                f"text model of (it takes {', '.join(MULTIMODAL)}); a text checkpoint needs no "
                                "extraction: pass it to model.init_from")
    if not isinstance(raw.get("text_config"), dict):
        raise HFCheckpointError(f"{file}: no text_config object")
    model_type, arch = MULTIMODAL[kind]
    text = raw["text_config"]
    if "rope_parameters" in text:  # transformers 5 writes it complete, per layer type: its own defaults
        defaults = {k: v for k, v in TEXT_DEFAULTS[kind].items() if k not in ("rope_theta", "rope_local_base_freq")}
    else:
        defaults = TEXT_DEFAULTS[kind]
    ids = {k: raw[k] for k in IDS if raw.get(k) is not None}
    return {**defaults, **ids, **text, "model_type": model_type, "architectures": [arch]}
