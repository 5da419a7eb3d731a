"""The multimodal Gemma 3 checkpoint's config.json (model_type gemma3,
Gemma3ForConditionalGeneration) read into a `VisionLanguageConfig`: the language model's
ModelConfig (its text_config, completed with transformers' defaults as
megaft.models.hf.multimodal does), the SigLIP tower's `SiglipConfig` and the image tokens.
Every vision_config field is read or refused, as the text families' specs do."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from megaft.config.model import ModelConfig
from megaft.models.arch.spec import GENERIC, HFConfigError, is_metadata
from megaft.models.hf.config import CONFIG, model_config_of, read_hf_config
from megaft.models.hf.multimodal_config import text_config

# transformers' SiglipVisionConfig defaults (a published vision_config lists what differs)
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6, "attention_dropout": 0.0, "vision_use_head": True}
VISION_FIELDS = frozenset(SIGLIP_DEFAULTS)
# Gemma3Config's own fields besides text_config / vision_config
TOP_FIELDS = frozenset(("mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index",
                        "tie_word_embeddings", "text_config", "vision_config"))


@dataclass(frozen=True)
class SiglipConfig:
    """The SigLIP vision tower (transformers' SiglipVisionModel without its pooling head)."""
    dim: int = 32  # hidden_size
    ffn_dim: int = 64  # intermediate_size (fc1 -> gelu_tanh -> fc2)
    n_layers: int = 1  # num_hidden_layers
    n_heads: int = 2  # num_attention_heads
    image_size: int = 28  # pixels per side; the image processor resizes to it
    patch_size: int = 14  # pixels per side of a patch (the stride-patch_size conv)
    channels: int = 3  # num_channels
    eps: float = 1e-6  # layer_norm_eps (the tower's LayerNorms and the projector's RMSNorm)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class VisionLanguageConfig:
    """Gemma3ForConditionalGeneration: `text` (a gemma3_text ModelConfig), `vision`, and the
    image tokens: each image becomes boi, mm_tokens_per_image image tokens, eoi."""
    text: ModelConfig
    vision: SiglipConfig
    mm_tokens_per_image: int = 256  # pooled vision tokens per image (a square number)
    image_token_id: int = 262144  # the placeholder the image features replace
    boi_token_id: int = 255999  # <start_of_image>
    eoi_token_id: int = 256000  # <end_of_image>
    extra: dict = field(default_factory=dict)  # top-level ids kept for export (bos/eos/pad)

    @property
    def pool(self) -> int:
        """The projector's average-pooling kernel (patches per side / tokens per side)."""
        return self.vision.patches_per_side // int(round(self.mm_tokens_per_image ** 0.5))


def is_multimodal(raw: dict) -> bool:
    return raw.get("model_type") == "gemma3" and isinstance(raw.get("vision_config"), dict)


def siglip_config(raw: dict, file: str) -> SiglipConfig:
    """The tower of a vision_config object; refuses fields megaft does not compute."""
    unknown = sorted(k for k in raw if k not in VISION_FIELDS and k not in GENERIC and not is_metadata(k))
    if unknown:
        raise HFConfigError(f"{file}: vision_config fields {unknown} are not understood by megaft's SigLIP tower")
    got = {**SIGLIP_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    if got.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise HFConfigError(f"{file}: vision_config model_type {got['model_type']!r}: megaft runs a SigLIP tower "
                            "(siglip_vision_model)")
    if got["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise HFConfigError(f"{file}: vision_config hidden_act {got['hidden_act']!r} is not supported "
                            "(SigLIP's gelu_pytorch_tanh)")
    if got["attention_dropout"]:
        raise HFConfigError(f"{file}: vision_config attention_dropout={got['attention_dropout']} is not supported "
                            "(megaft's tower has no dropout)")
    if got["vision_use_head"]:
        raise HFConfigError(f"{file}: vision_config vision_use_head=true: Gemma 3 never reads SigLIP's pooling head "
                            "(the published configs set false); fix: set vision_use_head to false in config.json "
                            "and drop the vision_tower.head.* tensors")
    return SiglipConfig(dim=got["hidden_size"], ffn_dim=got["intermediate_size"], n_layers=got["num_hidden_layers"],
                        n_heads=got["num_attention_heads"], image_size=got["image_size"],
                        patch_size=got["patch_size"], channels=got["num_channels"], eps=float(got["layer_norm_eps"]))


def vision_language_config(path: str, base: Optional[ModelConfig] = None) -> VisionLanguageConfig:
    """The VisionLanguageConfig of the multimodal Gemma 3 checkpoint in `path`."""
    raw, file = read_hf_config(path), os.path.join(path, CONFIG)
    if not is_multimodal(raw):
        raise HFConfigError(f"{file}: model_type {raw.get('model_type')!r} with no vision_config is not a "
                            "multimodal Gemma 3 checkpoint (model_type gemma3)")
    unknown = sorted(k for k in raw if k not in TOP_FIELDS and k not in GENERIC and not is_metadata(k))
    if unknown:
        raise HFConfigError(f"{file}: config.json fields {unknown} are not understood by megaft's gemma3 "
                            "(Gemma3ForConditionalGeneration) reader")
    text = text_config(raw, file)
    if "tie_word_embeddings" in raw:  # Gemma3Config carries it at the top (transformers 5)
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    lm = model_config_of(text, file, path, base)
    vision = siglip_config(raw["vision_config"], file)
    cfg = VisionLanguageConfig(
        text=lm, vision=vision, mm_tokens_per_image=int(raw.get("mm_tokens_per_image", 256)),
        image_token_id=int(raw.get("image_token_index", 262144)), boi_token_id=int(raw.get("boi_token_index", 255999)),
        eoi_token_id=int(raw.get("eoi_token_index", 256000)),
        extra={k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw})
    side = int(round(cfg.mm_tokens_per_image ** 0.5))
    if side * side != cfg.mm_tokens_per_image or vision.patches_per_side % side:
        raise HFConfigError(f"{file}: mm_tokens_per_image={cfg.mm_tokens_per_image} must be a square whose side "
                            f"divides the {vision.patches_per_side} patches per side (image_size / patch_size)")
    return cfg


def vision_config_dict(cfg: VisionLanguageConfig, text: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json of `cfg` as Gemma3ForConditionalGeneration (transformers 4 and 5); `text`: the
    language model's config.json (megaft.models.hf.export.hf_config_dict)."""
    v = cfg.vision
    text = {k: val for k, val in text.items() if k not in ("architectures", "dtype", "torch_dtype")}
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": cfg.boi_token_id, "eoi_token_index": cfg.eoi_token_id,
        "image_token_index": cfg.image_token_id, "mm_tokens_per_image": cfg.mm_tokens_per_image,
        "tie_word_embeddings": text.get("tie_word_embeddings", True), **cfg.extra,
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": v.dim, "intermediate_size": v.ffn_dim,
                          "num_hidden_layers": v.n_layers, "num_attention_heads": v.n_heads,
                          "num_channels": v.channels, "image_size": v.image_size, "patch_size": v.patch_size,
                          "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": v.eps, "attention_dropout": 0.0,
                          "vision_use_head": False},
        "dtype": dtype, "torch_dtype": dtype,
    }
