"""A Qwen2.5-VL checkpoint's config.json (model_type qwen2_5_vl,
Qwen2_5_VLForConditionalGeneration) read into a `QwenVLConfig`: the language model's
ModelConfig (a Qwen2 decoder: its fields at the top of config.json as the published
checkpoints write them, or in text_config as transformers 5 saves them; completed with
transformers' Qwen2_5_VLTextConfig defaults), the vision tower's `QwenVisionConfig`, M-RoPE's
mrope_section and the image tokens. Every field is read or refused, as the text families'
specs do; config.json is written back in the published (flat) form."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from megaft.config.model import ModelConfig
from megaft.models.arch.spec import GENERIC, HFConfigError, is_metadata
from megaft.models.hf.config import CONFIG, model_config_of, read_hf_config

# transformers' Qwen2_5_VLVisionConfig defaults (in_chans / spatial_patch_size: the published aliases)
VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
                   "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                   "tokens_per_second": 4, "window_size": 112, "out_hidden_size": 3584,
                   "fullatt_block_indexes": [7, 15, 23, 31]}
VISION_FIELDS = frozenset((*VISION_DEFAULTS, "in_chans", "spatial_patch_size", "rope_parameters", "rope_theta"))
# transformers' Qwen2_5_VLTextConfig defaults, written into the text model's config (the Qwen2 spec's differ)
TEXT_DEFAULTS = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu",
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "use_sliding_window": False,
                 "sliding_window": 4096, "max_window_layers": 80, "attention_dropout": 0.0, "rope_theta": 1000000.0,
                 "tie_word_embeddings": False}
TOP_FIELDS = frozenset(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                        "vision_token_id", "tie_word_embeddings", "text_config", "vision_config"))
TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
             "vision_end_token_id": 151653}


@dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision transformer (Qwen2_5_VisionTransformerPretrainedModel)."""
    dim: int = 32  # hidden_size
    ffn_dim: int = 48  # intermediate_size (SwiGLU with biases)
    n_layers: int = 2  # depth
    n_heads: int = 2  # num_heads
    out_dim: int = 64  # out_hidden_size: the merger's output (the language model's width)
    patch_size: int = 14  # pixels per side of a patch
    temporal_patch_size: int = 2  # frames per patch (an image is repeated to fill them)
    merge: int = 2  # spatial_merge_size: merge x merge patches become one language-model token
    window_size: int = 112  # pixels per side of an attention window
    full_attention: tuple = (7, 15, 23, 31)  # fullatt_block_indexes: blocks that see the whole image
    channels: int = 3  # in_channels
    rope_theta: float = 10000.0  # the 2-D (axial) rotary's base
    tokens_per_second: int = 4  # videos only (refused); kept for export

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x temporal x patch x patch."""
        return self.channels * self.temporal_patch_size * self.patch_size ** 2


@dataclass(frozen=True)
class QwenVLConfig:
    """Qwen2_5_VLForConditionalGeneration: `text` (a qwen2 ModelConfig), `vision`, M-RoPE's
    `mrope_section` (rotary frequency pairs of the temporal, height and width positions) and
    the image tokens: each image becomes <|vision_start|>, its tokens, <|vision_end|>."""
    text: ModelConfig
    vision: QwenVisionConfig
    mrope_section: tuple = (16, 24, 24)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    extra: dict = field(default_factory=dict)  # top-level ids kept for export (the published vision_token_id)


def is_qwen_vl(raw: dict) -> bool:
    return raw.get("model_type") == "qwen2_5_vl"


def qwen_vision_config(raw: dict, file: str) -> QwenVisionConfig:
    """The tower of a vision_config object; refuses fields megaft does not compute."""
    unknown = sorted(k for k in raw if k not in VISION_FIELDS and k not in GENERIC and not is_metadata(k))
    if unknown:
        raise HFConfigError(f"{file}: vision_config fields {unknown} are not understood by megaft's Qwen2.5-VL tower")
    got = {**VISION_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    got["in_channels"] = got.pop("in_chans", got["in_channels"])
    if got.get("spatial_patch_size", got["patch_size"]) != got["patch_size"]:
        raise HFConfigError(f"{file}: vision_config spatial_patch_size={got['spatial_patch_size']} differs from "
                            f"patch_size={got['patch_size']}; fix: make them equal (transformers reads patch_size)")
    if got["hidden_act"] != "silu":
        raise HFConfigError(f"{file}: vision_config hidden_act {got['hidden_act']!r} is not supported (Qwen2.5-VL's "
                            "silu)")
    rope = dict(got.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") != "axial":
        raise HFConfigError(f"{file}: vision_config rope_type {rope['rope_type']!r}: megaft runs the axial rotary")
    dim, heads = got["hidden_size"], got["num_heads"]
    if dim % heads or (dim // heads) % 4:
        raise HFConfigError(f"{file}: vision_config hidden_size={dim} / num_heads={heads} must be a multiple of 4 "
                            "(the 2-D rotary splits each head in height and width halves)")
    bad = [i for i in got["fullatt_block_indexes"] if not 0 <= i < got["depth"]]
    if bad:
        raise HFConfigError(f"{file}: vision_config fullatt_block_indexes {bad} are not blocks of depth="
                            f"{got['depth']}")
    unit = got["spatial_merge_size"] * got["patch_size"]
    if got["window_size"] % unit:
        raise HFConfigError(f"{file}: vision_config window_size={got['window_size']} must be a multiple of "
                            f"spatial_merge_size * patch_size = {unit}")
    return QwenVisionConfig(
        dim=dim, ffn_dim=got["intermediate_size"], n_layers=got["depth"], n_heads=heads,
        out_dim=got["out_hidden_size"], patch_size=got["patch_size"], temporal_patch_size=got["temporal_patch_size"],
        merge=got["spatial_merge_size"], window_size=got["window_size"],
        full_attention=tuple(got["fullatt_block_indexes"]), channels=got["in_channels"],
        rope_theta=float(rope.get("rope_theta", got.get("rope_theta", 10000.0))),
        tokens_per_second=got["tokens_per_second"])


def _text_fields(raw: dict, file: str) -> tuple[dict, tuple]:
    """(the language model's config.json as the qwen2 spec reads it, mrope_section)."""
    if isinstance(raw.get("text_config"), dict):  # transformers 5
        text = {k: v for k, v in raw["text_config"].items() if k != "layer_types" or v}
    else:  # the published form: the text fields at the top
        text = {k: v for k, v in raw.items() if k not in TOP_FIELDS and not k.endswith("_token_id")}
        text.update({k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw})
    text = {**TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    text.pop("rope_scaling", None)
    section = rope.pop("mrope_section", None)
    if rope.pop("rope_type", rope.pop("type", "default")) not in ("default", "mrope") or set(rope) - {"rope_theta"}:
        raise HFConfigError(f"{file}: rope parameters {rope}: megaft's Qwen2.5-VL reads M-RoPE with the default "
                            "frequencies only (rope_theta, mrope_section)")
    text["rope_theta"] = rope.get("rope_theta", text["rope_theta"])
    if not section:
        raise HFConfigError(f"{file}: no mrope_section in rope_scaling / rope_parameters; fix: the checkpoint's "
                            "own config.json (Qwen2.5-VL writes [16, 24, 24])")
    text.pop("model_type", None)
    return {**text, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, tuple(section)


def qwen_vl_config(path: str, base: Optional[ModelConfig] = None) -> QwenVLConfig:
    """The QwenVLConfig of the Qwen2.5-VL checkpoint in `path`."""
    raw, file = read_hf_config(path), os.path.join(path, CONFIG)
    if not is_qwen_vl(raw):
        raise HFConfigError(f"{file}: model_type {raw.get('model_type')!r} is not a Qwen2.5-VL checkpoint")
    if not isinstance(raw.get("vision_config"), dict):
        raise HFConfigError(f"{file}: no vision_config object")
    text, section = _text_fields(raw, file)
    lm = model_config_of(text, file, path, base)
    vision = qwen_vision_config(raw["vision_config"], file)
    if sum(section) * 2 != lm.hd:
        raise HFConfigError(f"{file}: mrope_section {list(section)} sums to {sum(section)}, not head_dim / 2 = "
                            f"{lm.hd // 2}")
    if vision.out_dim != lm.dim:
        raise HFConfigError(f"{file}: vision_config out_hidden_size={vision.out_dim} differs from the language "
                            f"model's hidden_size={lm.dim}")
    ids = {k: int(raw.get(k, TOKEN_IDS[k])) for k in TOKEN_IDS}
    return QwenVLConfig(text=lm, vision=vision, mrope_section=section, **ids,
                        extra={k: raw[k] for k in ("vision_token_id",) if k in raw})


def qwen_config_dict(cfg: QwenVLConfig, text: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json of `cfg` in the published (flat) form, which transformers 4 and 5 read;
    `text`: the language model's config.json (megaft.models.hf.export.hf_config_dict)."""
    v = cfg.vision
    text = {k: val for k, val in text.items()
            if k not in ("architectures", "model_type", "dtype", "torch_dtype", "rope_parameters", "rope_scaling",
                         "rope_theta", "layer_types")}
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **text,
        "rope_theta": cfg.text.rope_theta, "rope_scaling": {"type": "mrope", "mrope_section": list(cfg.mrope_section)},
        **{k: getattr(cfg, k) for k in TOKEN_IDS}, **cfg.extra,
        "vision_config": {"model_type": "qwen2_5_vl", "depth": v.n_layers, "hidden_size": v.dim,
                          "intermediate_size": v.ffn_dim, "num_heads": v.n_heads, "in_chans": v.channels,
                          "out_hidden_size": v.out_dim, "patch_size": v.patch_size,
                          "spatial_patch_size": v.patch_size, "spatial_merge_size": v.merge,
                          "temporal_patch_size": v.temporal_patch_size, "window_size": v.window_size,
                          "fullatt_block_indexes": list(v.full_attention), "tokens_per_second": v.tokens_per_second,
                          "hidden_act": "silu"},
        "dtype": dtype, "torch_dtype": dtype,
    }
