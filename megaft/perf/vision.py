"""The vision tower and projector of a vision-language model (megaft.models.vision), counted
per image at its resolution: parameters and model FLOPs (not activation bytes yet, issue 43), with the same
conventions as megaft.perf.counts (MFU counts the FLOPs the model needs: 2 per weight a
patch is multiplied by in the forward, 6 in training; the attention core over every pair of
patches, as the tower attends both ways).

Not yet read by megaft-plan or the trainer's MFU (images are not trained by megaft-train
yet, docs/vision.md); tests/test_perf_vision.py checks each count against the module and torch's
FlopCounterMode."""
from __future__ import annotations

from megaft.models.vision.config import SiglipConfig, VisionLanguageConfig


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
