"""Qwen2.5-VL's vision transformer as transformers computes it
(Qwen2_5_VisionTransformerPretrainedModel): a bias-free Conv3d over each flattened patch
(channels x temporal_patch_size x patch x patch), pre-RMSNorm blocks of bidirectional
attention with a 2-D (axial) rotary over the patch's row and column and a SwiGLU MLP (with
biases), then the patch merger (RMSNorm, merge x merge neighbouring patches concatenated, a
GELU MLP to the language model's width).

Attention is windowed: the patches are reordered window by window (windows of
window_size pixels, counted in merged patches) and each block attends inside a window,
except the blocks of fullatt_block_indexes, which attend inside the whole image. The merged
tokens are put back in the image's row-major order at the end.

Parameter names are transformers' (`patch_embed.proj`, `blocks.N.attn.qkv`, `merger.mlp.0`,
...). The tower is replicated on every tp rank, as Gemma 3's (megaft.models.vision.siglip
says why no collective is needed)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaft.layers import RMSNorm
from megaft.models.vision.qwen_config import QwenVisionConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of each patch in the processor's order: merge x merge blocks
    row-major, patches row-major inside each (transformers' get_vision_position_ids)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        out.append(torch.stack([rows.reshape(shape).transpose(1, 2).flatten(),
                                cols.reshape(shape).transpose(1, 2).flatten()], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(the merged tokens' order window by window [tokens], each window's patch count): windows of
    `window` merged tokens per side, row-major, the last ones cut by the image's edge
    (transformers' get_vision_window_index without its empty windows)."""
    order, lengths, first = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cell = index[frame, r:r + window, c:c + window].flatten()
                    order.append(cell + first)
                    lengths.append(len(cell) * merge * merge)
        first += t * gh * gw
    return torch.cat(order), lengths


class QwenPatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.shape = (cfg.channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(cfg.channels, cfg.dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[patches, patch_dim] -> [patches, dim]."""
        x = patches.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class QwenVisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, cfg.dim * 3)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [patches, dim]; attention inside each run of `lengths` patches."""
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)  # in fp32, as transformers
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in part))
                for part in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.proj(torch.cat(outs, dim=2).squeeze(0).transpose(0, 1).reshape(n, d))


class QwenVisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim), nn.Linear(cfg.dim, cfg.ffn_dim)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenVisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.dim, eps=1e-6), RMSNorm(cfg.dim, eps=1e-6)
        self.attn = QwenVisionAttention(cfg)
        self.mlp = QwenVisionMLP(cfg)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class QwenPatchMerger(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.width = cfg.dim * cfg.merge ** 2
        self.ln_q = RMSNorm(cfg.dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTower(nn.Module):
    """Flattened patches [patches, patch_dim] of images of grids `grid_thw` [images, 3] (t, h, w
    in patches) -> [patches / merge², out_dim], the images' tokens in order."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = QwenPatchEmbed(cfg)
        self.blocks = nn.ModuleList(QwenVisionBlock(cfg) for _ in range(cfg.n_layers))
        self.merger = QwenPatchMerger(cfg)
        half = cfg.dim // cfg.n_heads // 2
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rotary(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim]: the row's frequencies, then the column's, twice."""
        pos = patch_positions(grid_thw, self.cfg.merge).to(self.inv_freq.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [patches, 2 * head_dim / 4]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg, unit = self.cfg, self.cfg.merge ** 2
        order, window_lengths = window_order(grid_thw, cfg.merge, cfg.window_size // cfg.merge // cfg.patch_size)
        order = order.to(patches.device)
        image_lengths = (grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0]).tolist()

        def windowed(t: torch.Tensor) -> torch.Tensor:  # merged-token order -> window order, per patch
            return t.view(-1, unit, t.shape[-1])[order].view(-1, t.shape[-1])

        x = windowed(self.patch_embed(patches))
        cos, sin = (windowed(t) for t in self.rotary(grid_thw))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, image_lengths if i in cfg.full_attention else window_lengths)
        return self.merger(x)[torch.argsort(order)]
