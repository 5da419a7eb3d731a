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


@pytest.mark.parametrize("h, w", [(4, 6), (8, 12), (6, 4)])
def test_qwen_counts_equal_the_modules(h, w):
    """Qwen2.5-VL's tower at three image sizes (windows cut by the edge, one full-attention block):
    parameters against the module's, window sizes against the tower's own order, forward FLOPs
    against FlopCounterMode (conv and linears) plus the attention cores as explicit matmuls."""
    from megaft.models.vision.qwen_config import QwenVisionConfig
    from megaft.models.vision.qwen_tower import QwenVisionTower, window_order
    from megaft.perf.vision import (
        qwen_attention_flops,
        qwen_tower_params,
        qwen_vision_forward_flops,
        qwen_vision_train_flops,
        qwen_window_lengths,
    )

    v = QwenVisionConfig(dim=32, ffn_dim=48, n_layers=3, n_heads=2, out_dim=64, patch_size=4, merge=2,
                         window_size=16, full_attention=(1,))
    tower = QwenVisionTower(v)
    assert qwen_tower_params(v) == sum(p.numel() for p in tower.parameters())
    grid = torch.tensor([[1, h, w]])
    assert qwen_window_lengths(v, h, w) == window_order(grid, v.merge, 2)[1]
    with FlopCounterMode(display=False) as counter:
        tower(torch.randn(h * w, v.patch_dim), grid)
    core = 0
    for lengths in [qwen_window_lengths(v, h, w)] * 2 + [[h * w]]:  # two windowed blocks, one full
        for n in lengths:
            q = torch.randn(1, v.n_heads, n, v.dim // v.n_heads)
            with FlopCounterMode(display=False) as one:
                torch.softmax(q @ q.transpose(-1, -2), -1) @ q
            core += one.get_total_flops()
    assert qwen_attention_flops(v, h, w) == core > 0
    measured = counter.get_total_flops() + core
    assert qwen_vision_forward_flops(v, h, w) == measured
    assert qwen_vision_train_flops(v, h, w) == 3 * measured
    assert qwen_vision_train_flops(v, h, w, frozen=True) == 2 * measured


def test_published_qwen2_5_vl_tower():
    """Qwen2.5-VL-7B's tower (32 blocks of 1280, SwiGLU 3420, merger to 3584), built on the meta
    device: the count is the module's."""
    from megaft.models.vision.qwen_config import QwenVisionConfig
    from megaft.models.vision.qwen_tower import QwenVisionTower
    from megaft.perf.vision import qwen_tower_params

    v = QwenVisionConfig(dim=1280, ffn_dim=3420, n_layers=32, n_heads=16, out_dim=3584, patch_size=14, merge=2,
                         window_size=112, full_attention=(7, 15, 23, 31))
    with torch.device("meta"):
        tower = QwenVisionTower(v)
    assert qwen_tower_params(v) == sum(p.numel() for p in tower.parameters()) > 6e8


def _saved_elements(module, *args) -> int:
    """fp32 elements the forward saves for backward: distinct storages, no parameter, no index tensor."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and t.dtype == torch.float32:
            seen[storage.data_ptr()] = storage.nbytes() // 4
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return sum(seen.values())


@pytest.mark.parametrize("layers", [1, 3])
def test_tower_activations_are_what_the_towers_save(layers):
    """The activation counts equal the elements the modules save for backward (fp32, CPU kernels):
    SigLIP at its resolution, Qwen2.5-VL's tower at two image sizes with windowed and full blocks."""
    from megaft.models.vision.qwen_config import QwenVisionConfig
    from megaft.models.vision.qwen_tower import QwenVisionTower
    from megaft.perf.vision import qwen_tower_activation_elements, tower_activation_elements

    torch.manual_seed(0)
    s = SiglipConfig(dim=64, ffn_dim=96, n_layers=layers, n_heads=4, image_size=56, patch_size=7)
    assert _saved_elements(SiglipTower(s), torch.randn(2, 3, 56, 56)) == 2 * tower_activation_elements(s)
    v = QwenVisionConfig(dim=64, ffn_dim=96, n_layers=layers, n_heads=4, out_dim=48, patch_size=14, merge=2,
                         window_size=56, full_attention=(0,))
    tower = QwenVisionTower(v)
    for h, w in [(16, 16), (12, 20)]:
        got = _saved_elements(tower, torch.randn(h * w, v.patch_dim), torch.tensor([[1, h, w]]))
        assert got == qwen_tower_activation_elements(v, h, w), (h, w)
