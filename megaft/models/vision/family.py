"""Which vision-language model a checkpoint is: its config reader and its model class, by
config.json's model_type (gemma3: megaft.models.vision.model; qwen2_5_vl:
megaft.models.vision.qwen_model)."""
from __future__ import annotations

from typing import Optional

from torch import nn

from megaft.config.model import ModelConfig
from megaft.models.hf.config import read_hf_config
from megaft.models.vision.config import VisionLanguageConfig, vision_language_config
from megaft.models.vision.qwen_config import QwenVLConfig, is_qwen_vl, qwen_vl_config


def vision_config_of(path: str, base: Optional[ModelConfig] = None) -> VisionLanguageConfig | QwenVLConfig:
    """The config of the vision-language checkpoint in `path` (its `text`: the language model's)."""
    if is_qwen_vl(read_hf_config(path)):
        return qwen_vl_config(path, base)
    return vision_language_config(path, base)


def build_vision_language(cfg: VisionLanguageConfig | QwenVLConfig, **kwargs) -> nn.Module:
    """The model of `cfg` (kwargs: group, sequence_parallel, kernels, and under pp language_model:
    this rank's stages, megaft.pipeline.vision)."""
    if isinstance(cfg, QwenVLConfig):
        from megaft.models.vision.qwen_model import QwenVLModel

        return QwenVLModel(cfg, **kwargs)
    from megaft.models.vision.model import VisionLanguageModel

    return VisionLanguageModel(cfg, **kwargs)


def tower_parts(model: nn.Module) -> dict[str, list[nn.Module]]:
    """model.freeze's names -> the modules they freeze: `vision` the tower, `projector` what maps
    its features to the language model (Gemma 3's multi_modal_projector, Qwen2.5-VL's patch merger)."""
    if hasattr(model, "visual"):
        tower = model.visual
        if tower is None:  # a pipeline rank without the first stage holds no tower
            return {"vision": [], "projector": []}
        return {"vision": [tower.patch_embed, tower.blocks], "projector": [tower.merger]}
    if model.vision_tower is None:
        return {"vision": [], "projector": []}
    return {"vision": [model.vision_tower], "projector": [model.multi_modal_projector]}
