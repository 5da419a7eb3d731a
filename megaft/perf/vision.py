"""The vision tower and projector of a vision-language model (megaft.models.vision), counted
per image at its resolution: parameters and model FLOPs (not activation bytes yet, issue 43), with the same
conventions as megaft.perf.counts (MFU counts the FLOPs the model needs: 2 per weight a
patch is multiplied by in the forward, 6 in training; the attention core over every pair of
patches, as the tower attends both ways).

Qwen2.5-VL's tower (`qwen_*`) is counted per image of h x w patches (its size after
smart_resize), its windowed blocks attending within each window.

The trainer's MFU adds `image_flops` of every image of a step's global batch to its text FLOPs
(megaft.training.objectives.images); tests/test_perf_vision.py checks each count against the
module and torch's FlopCounterMode."""
from __future__ import annotations

from typing import Optional, Sequence

from megaft.models.vision.config import SiglipConfig, VisionLanguageConfig
from megaft.models.vision.qwen_config import QwenVisionConfig, QwenVLConfig


def tower_params(v: SiglipConfig) -> int:
    """SigLIP's parameters: the patch conv and position table, per layer two LayerNorms, q/k/v/o
    and fc1/fc2 with biases, the final LayerNorm."""
    patches = v.patches_per_side ** 2
    embed = v.channels * v.patch_size ** 2 * v.dim + v.dim + patches * v.dim
    layer = 4 * v.dim + 4 * (v.dim * v.dim + v.dim) + (v.dim * v.ffn_dim + v.ffn_dim) + (v.ffn_dim * v.dim + v.dim)
    return embed + v.n_layers * layer + 2 * v.dim


def projector_params(cfg: VisionLanguageConfig) -> int:
    """Gemma 3's projector: its RMSNorm weight and the [vision dim, text dim] projection."""
    return cfg.vision.dim + cfg.vision.dim * cfg.text.dim


def vision_forward_flops(cfg: VisionLanguageConfig) -> float:
    """Forward FLOPs of one image through the tower and the projector: 2 per weight per patch for
    the conv and the linears, the attention core (scores and values over all patch pairs), and
    the projection of the mm_tokens_per_image pooled tokens (norms, pooling and GELU are not
    matmuls and do not count)."""
    v = cfg.vision
    patches = v.patches_per_side ** 2
    conv = 2.0 * patches * v.channels * v.patch_size ** 2 * v.dim
    linears = 2.0 * patches * (4 * v.dim * v.dim + 2 * v.dim * v.ffn_dim)
    return (conv + v.n_layers * (linears + tower_attention_flops(v))
            + 2.0 * cfg.mm_tokens_per_image * v.dim * cfg.text.dim)


def tower_attention_flops(v: SiglipConfig) -> float:
    """Forward FLOPs of one layer's attention core for one image: q·k over every pair of patches,
    then the weighted values, 2 FLOPs each: 4 * patches² * dim."""
    patches = v.patches_per_side ** 2
    return 4.0 * patches * patches * v.dim


def vision_train_flops(cfg: VisionLanguageConfig, *, frozen: bool = False) -> float:
    """Training FLOPs of one image: forward, input gradient and weight gradient (3 forwards); a
    frozen tower (model.freeze, to come) needs no weight gradient (2 forwards)."""
    return (2.0 if frozen else 3.0) * vision_forward_flops(cfg)


def qwen_tower_params(v: QwenVisionConfig) -> int:
    """Qwen2.5-VL's tower: the bias-free patch conv, per block two RMSNorms, qkv and proj and the
    SwiGLU MLP with biases, then the merger (RMSNorm, merge² x dim -> same -> out_dim, with biases)."""
    layer = 2 * v.dim + (v.dim * 3 * v.dim + 3 * v.dim) + (v.dim * v.dim + v.dim) \
        + 2 * (v.dim * v.ffn_dim + v.ffn_dim) + (v.ffn_dim * v.dim + v.dim)
    width = v.dim * v.merge ** 2
    merger = v.dim + (width * width + width) + (width * v.out_dim + v.out_dim)
    return v.patch_dim * v.dim + v.n_layers * layer + merger


def qwen_window_lengths(v: QwenVisionConfig, h: int, w: int) -> list[int]:
    """Patches per attention window of an image of h x w patches (windows of window_size pixels,
    the last ones cut by the image's edge)."""
    m, win = v.merge, v.window_size // v.merge // v.patch_size  # a window's side in merged tokens
    gh, gw = h // m, w // m
    return [min(win, gh - r) * min(win, gw - c) * m * m for r in range(0, gh, win) for c in range(0, gw, win)]


def qwen_attention_flops(v: QwenVisionConfig, h: int, w: int) -> float:
    """Forward FLOPs of the attention cores of all blocks for one image of h x w patches: 4 * n² * dim
    per window of n patches in a windowed block, per image (n = h * w) in a full-attention block."""
    windowed = sum(4.0 * n * n * v.dim for n in qwen_window_lengths(v, h, w))
    full = 4.0 * (h * w) ** 2 * v.dim
    n_full = sum(1 for i in range(v.n_layers) if i in v.full_attention)
    return n_full * full + (v.n_layers - n_full) * windowed


def qwen_vision_forward_flops(v: QwenVisionConfig, h: int, w: int) -> float:
    """Forward FLOPs of one image of h x w patches (its grid, after smart_resize) through the tower
    and the merger: 2 per weight per patch for the conv and the linears, the attention cores, and
    the merger's two linears per merged token."""
    patches, width = h * w, v.dim * v.merge ** 2
    conv = 2.0 * patches * v.patch_dim * v.dim
    linears = 2.0 * patches * (4 * v.dim * v.dim + 3 * v.dim * v.ffn_dim)
    merger = 2.0 * (patches // v.merge ** 2) * (width * width + width * v.out_dim)
    return conv + v.n_layers * linears + qwen_attention_flops(v, h, w) + merger


def qwen_vision_train_flops(v: QwenVisionConfig, h: int, w: int, *, frozen: bool = False) -> float:
    """Training FLOPs of one image: 3 forwards, or 2 with model.freeze=[vision,projector]."""
    return (2.0 if frozen else 3.0) * qwen_vision_forward_flops(v, h, w)


def image_flops(cfg: VisionLanguageConfig | QwenVLConfig, grid: Optional[Sequence[int]] = None, *,
                trains: bool = True) -> float:
    """Model FLOPs of one image in a training step: 3 forwards when some of the tower or projector
    trains (a partly frozen tower is counted as trained), 1 when none of it does (model.freeze=[vision,
    projector], or LoRA on the language model): the pixels need no gradient, so no backward runs
    through it. `grid`: Qwen2.5-VL's (t, h, w) of the image, in patches."""
    if isinstance(cfg, QwenVLConfig):
        forward = qwen_vision_forward_flops(cfg.vision, int(grid[1]), int(grid[2]))
    else:
        forward = vision_forward_flops(cfg)
    return (3.0 if trains else 1.0) * forward


def images_flops(cfg: VisionLanguageConfig | QwenVLConfig, n_images: int,
                 grids: Optional[Sequence[Sequence[int]]] = None, *, trains: bool = True) -> float:
    """`image_flops` of a conversation's `n_images` images (Qwen2.5-VL: each at its row of `grids`)."""
    if isinstance(cfg, QwenVLConfig):
        return sum(image_flops(cfg, g, trains=trains) for g in grids)
    return n_images * image_flops(cfg, trains=trains)


def tower_activation_elements(v: SiglipConfig) -> int:
    """Elements SigLIP saves for backward per image (fp32, the torch kernels; weights not counted): per
    patch its pixels, per layer both LayerNorms' input, mean, rstd and output, q, k, v, the attention
    output and its log-sum-exp per head, the residual the second norm reads and the MLP's two
    activations (8 * dim + 2 * ffn + heads + 4), and the final LayerNorm's input and statistics.
    Gemma 3's projector (mm_tokens_per_image rows) is not counted."""
    per_patch = v.channels * v.patch_size ** 2 + v.n_layers * (8 * v.dim + 2 * v.ffn_dim + v.n_heads + 4) + v.dim + 2
    return v.patches_per_side ** 2 * per_patch


def qwen_tower_activation_elements(v: QwenVisionConfig, h: int, w: int) -> int:
    """Elements Qwen2.5-VL's tower saves for backward per image of h x w patches (fp32, the torch kernels;
    weights and index tensors not counted): per patch its flattened pixels, the rotary cos and sin, per
    block both RMSNorms' input, rstd, normalized rows and output, the qkv output, the rotated q and k,
    the attention output and its log-sum-exp per head, the projection's input and the SwiGLU's four
    (13 * dim + 4 * ffn + heads + 2, windowed or not), and the merger's norm and two activations."""
    hd = v.dim // v.n_heads
    per_patch = v.patch_dim + 2 * hd + v.n_layers * (13 * v.dim + 4 * v.ffn_dim + v.n_heads + 2) + 5 * v.dim + 1
    return h * w * per_patch
