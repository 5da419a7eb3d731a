"""megaft.perf.vision against the modules it counts: parameters against the SigLIP tower's and
the projector's own, forward FLOPs against torch's FlopCounterMode over one image."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaft.config.model import ModelConfig
from megaft.models.vision.config import SiglipConfig, VisionLanguageConfig
from megaft.models.vision.model import VisionLanguageModel
from megaft.models.vision.siglip import SiglipTower
from megaft.perf.vision import (
    projector_params,
    tower_attention_flops,
    tower_params,
    vision_forward_flops,
    vision_train_flops,
)


def _config(v: SiglipConfig, mm_tokens: int) -> VisionLanguageConfig:
    text = ModelConfig(dim=48, n_layers=1, n_heads=2, ffn_dim=64, vocab_size=40, max_seq_len=64)
    return VisionLanguageConfig(text=text, vision=v, mm_tokens_per_image=mm_tokens, image_token_id=39)


@pytest.mark.parametrize("vision, mm_tokens", [
    (SiglipConfig(dim=32, ffn_dim=48, n_layers=2, n_heads=2, image_size=28, patch_size=7), 4),
    (SiglipConfig(dim=24, ffn_dim=40, n_layers=1, n_heads=3, image_size=36, patch_size=6, channels=3), 9),
])
def test_counts_equal_the_modules(vision, mm_tokens):
    cfg = _config(vision, mm_tokens)
    model = VisionLanguageModel(cfg)
    assert tower_params(vision) == sum(p.numel() for p in model.vision_tower.parameters())
    assert projector_params(cfg) == sum(p.numel() for p in model.multi_modal_projector.parameters())
    pixels = torch.randn(1, vision.channels, vision.image_size, vision.image_size)
    with FlopCounterMode(display=False) as counter:
        model.image_features(pixels)
    # FlopCounterMode counts the conv and the matmuls but not the CPU SDPA kernel: the attention
    # core is checked on its own, as the explicit matmuls of the same shapes
    patches = vision.patches_per_side ** 2
    q = torch.randn(1, vision.n_heads, patches, vision.dim // vision.n_heads)
    with FlopCounterMode(display=False) as core:
        torch.softmax(q @ q.transpose(-1, -2), -1) @ q
    assert tower_attention_flops(vision) == core.get_total_flops() > 0
    measured = counter.get_total_flops() + vision.n_layers * core.get_total_flops()
    assert vision_forward_flops(cfg) == measured
    assert vision_train_flops(cfg) == 3 * measured and vision_train_flops(cfg, frozen=True) == 2 * measured


def test_published_gemma3_tower():
    """Gemma 3 4B/27B's SigLIP (tests/models/real_configs: 896 px, patch 14, 27 layers of 1152),
    built on the meta device: the count is the module's."""
    v = SiglipConfig(dim=1152, ffn_dim=4304, n_layers=27, n_heads=16, image_size=896, patch_size=14)
    with torch.device("meta"):
        tower = SiglipTower(v)
    assert tower_params(v) == sum(p.numel() for p in tower.parameters()) > 4e8
