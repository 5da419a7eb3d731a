"""SigLIP's vision transformer as Gemma 3 runs it (transformers' SiglipVisionModel without
the pooling head): a stride-patch_size conv into patches, learned position embeddings,
pre-LayerNorm blocks of bidirectional attention and a gelu_tanh MLP (all with biases), a
final LayerNorm. Parameter names are transformers' (`embeddings.patch_embedding`,
`encoder.layers.N.self_attn.q_proj`, ...).

The tower is replicated on every tp rank (docs/vision.md): it is a few percent of a
Gemma 3 model's FLOPs, and every tp rank then holds the same features and, without
sequence parallel, receives the same gradient for them, so its parameters' gradients agree
across tp with no collective."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaft.models.vision.config import SiglipConfig


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.channels, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2, cfg.dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, channels, size, size] -> [images, patches, dim] (patches row-major)."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(cfg.dim, cfg.dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def heads(t):
            return t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)

        # every patch sees every patch of its image; SDPA's default scale is head_dim ** -0.5, SigLIP's
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.dim, cfg.ffn_dim), nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.n_layers))


class SiglipTower(nn.Module):
    """pixel values [images, channels, image_size, image_size] -> the last hidden states
    [images, patches, dim] after the final LayerNorm."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.dim, eps=cfg.eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
