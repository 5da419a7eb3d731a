"""Gemma 3's multi_modal_projector: the tower's patches average-pooled to
mm_tokens_per_image tokens (a square grid), RMSNorm with Gemma's (1 + w) weight, then a
bias-free projection to the language model's width stored as [vision dim, text dim]
(`mm_input_projection_weight`, transformers' name and layout). Replicated over tp, as the
tower (megaft.models.vision.siglip)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaft.layers import RMSNorm
from megaft.models.vision.config import VisionLanguageConfig


class Gemma3Projector(nn.Module):
    def __init__(self, cfg: VisionLanguageConfig):
        super().__init__()
        self.side, self.pool = cfg.vision.patches_per_side, cfg.pool
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.vision.dim, cfg.text.dim))
        # Gemma3RMSNorm: fp32, scaled by (1 + w); the vision config's layer_norm_eps, as transformers
        self.mm_soft_emb_norm = RMSNorm(cfg.vision.dim, eps=cfg.vision.eps, offset=1.0)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision dim] -> [images, mm_tokens_per_image, text dim]."""
        n, _, d = patches.shape
        grid = patches.transpose(1, 2).reshape(n, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(patches)
