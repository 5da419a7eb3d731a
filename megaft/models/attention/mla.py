"""Multi-head latent attention (DeepSeek-V2/V3, transformers' DeepseekV3Attention).

Queries come from a low-rank latent (q_a_proj, q_a_layernorm, q_b_proj) or one q_proj when
`q_lora_rank` is None; keys and values from a shared latent of `kv_lora_rank`
(kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj), whose last `head_dim` (= qk_rope_head_dim)
columns are one rotary key shared by every head. Each head's query/key is its unrotated part
(qk_nope_head_dim) followed by the rotary part; values are v_head_dim wide. RoPE touches the
rotary part only; with `rope_interleave` its dims come in pairs (x0, x1), (x2, x3), ...:
taking the even then the odd dims and rotating halves is transformers' computation exactly
(apply_rotary_pos_emb_interleave). Scores are scaled by qk_head_dim^-1/2, times mscale² under
YaRN with mscale_all_dim (transformers' yarn_apply_mscale).

Tensor parallel: q_b_proj / q_proj and kv_b_proj are column-parallel by heads, o_proj
row-parallel; the down projections are replicated. They run on this rank's tokens (its
sequence shard under sequence parallel, then their latents are all-gathered: narrower than
the hidden state) and their output enters the tp region (`column_input`), so the latents'
gradients, partial per rank, are summed there; under sequence parallel their weights are
sequence-parallel parameters (gradients summed over tp), and the latent norms, applied in
the tp region, take their weight through copy_to_tp (RMSNorm `group`).

Packed documents and context parallelism reuse the attention kernels and the ring of
megaft.models.attention, which take one head width: values are zero-padded to the query
width (their extra output columns are zero and cropped) and q carries the scale's ratio.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig
from megaft.kernels.linear import layer_linear
from megaft.kernels.rope import rope
from megaft.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from megaft.layers.linear import column_input
from megaft.models import recompute
from megaft.models.attention.documents import Docs, attend, rope_at
from megaft.models.attention.gqa import op_backend, rope_positions
from megaft.models.attention.rope import rope_kind
from megaft.parallel.comm import Group, group_size
from megaft.parallel.context.ring import ring_attention
from megaft.parallel.tensor.shard import mark_sequence_parallel

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with its default eps, not rms_norm_eps


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """transformers' DeepseekV3Attention.scaling: qk_head_dim^-1/2, times mscale(factor,
    mscale_all_dim)² for a scaled RoPE with mscale_all_dim."""
    scale = cfg.qk_head_dim ** -0.5
    s = cfg.rope_scaling or {}
    if rope_kind(s) != "default" and s.get("mscale_all_dim"):
        m = _yarn_mscale(s["factor"], s["mscale_all_dim"])
        scale = scale * m * m
    return scale


def interleave_order(width: int) -> torch.Tensor:
    """The even dims, then the odd ones: interleaved pairs -> halves."""
    return torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])


class MLAttention(nn.Module):
    """Multi-head latent attention; parameter names are transformers' (q_a_proj, q_a_layernorm,
    q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
                 kernels: Optional[KernelsConfig] = None, layer: int = 0, selective: bool = False):
        super().__init__()
        tp = group_size(group)
        self.group, self.sp, self.selective = group, sequence_parallel, selective
        self.rope_backend, lin = op_backend(kernels, "rope"), op_backend(kernels, "linear")
        self.n_heads, self.nope, self.rot, self.v = cfg.n_heads // tp, cfg.qk_nope_head_dim, cfg.hd, cfg.v_head_dim
        self.qk, self.q_lora, self.kv_lora = cfg.qk_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        self.scale = mla_softmax_scale(cfg)
        self.register_buffer("rope_order", interleave_order(cfg.hd) if cfg.rope_interleave else None,
                             persistent=False)
        col = dict(group=group, sequence_parallel=sequence_parallel, shared_input=True, backend=lin)
        norm = dict(eps=LATENT_NORM_EPS, backend=op_backend(kernels, "rmsnorm"), group=group if tp > 1 else None)
        if self.q_lora is None:
            self.q_proj = ColumnParallelLinear(cfg.dim, cfg.n_heads * self.qk, **col)
        else:
            self.q_a_proj = nn.Linear(cfg.dim, self.q_lora, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora, **norm)
            self.q_b_proj = ColumnParallelLinear(self.q_lora, cfg.n_heads * self.qk, **col)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, self.kv_lora + self.rot, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, **norm)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora, cfg.n_heads * (self.nope + self.v), **col)
        self.o_proj = RowParallelLinear(cfg.n_heads * self.v, cfg.dim, group=group,
                                        sequence_parallel=sequence_parallel, backend=lin)
        if sequence_parallel:  # the down projections see this rank's tokens only: grads summed over tp
            for proj in (getattr(self, "q_a_proj", None), self.kv_a_proj_with_mqa):
                if proj is not None:
                    mark_sequence_parallel(proj.weight)
        self.lin = lin
        self.cache = None  # a LayerCache while generating (megaft.inference.kv_cache.kv_cache)

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [b, s, heads * qk] of this rank's heads, kv latent [b, s, kv_lora], rotary key [b, s, rot]),
        over the whole sequence."""
        latent = layer_linear(x, self.kv_a_proj_with_mqa.weight, None, backend=self.lin)
        if self.q_lora is not None:  # two GEMMs (no weight copy), one collective for both latents
            latent = torch.cat([layer_linear(x, self.q_a_proj.weight, None, backend=self.lin), latent], dim=-1)
        latent = column_input(latent, self.group, self.sp)
        if self.q_lora is None:
            q = self.q_proj(column_input(x, self.group, self.sp))
            kv, k_rot = latent.split([self.kv_lora, self.rot], dim=-1)
        else:
            q_lat, kv, k_rot = latent.split([self.q_lora, self.kv_lora, self.rot], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_lat).to(latent.dtype))
        return q, self.kv_a_layernorm(kv).to(latent.dtype), k_rot

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Docs] = None) -> torch.Tensor:
        q, kv, k_rot = self._latents(x)
        b, s, _ = q.shape
        q = q.view(b, s, self.n_heads, self.qk).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rot], dim=-1)
        k_rot = k_rot.view(b, s, 1, self.rot).transpose(1, 2)  # one rotary key head, shared by all heads
        if self.rope_order is not None:
            q_rot, k_rot = q_rot[..., self.rope_order], k_rot[..., self.rope_order]
        if docs is not None:
            q_rot, k_rot = rope_at(q_rot.contiguous(), k_rot.contiguous(), cos, sin, docs, self.rope_backend)
        elif self.cache is not None:  # generating (megaft.inference.kv_cache): only the new positions
            at = self.cache.positions(s, cos.shape[0], x.device)
            q_rot, k_rot = rope_positions(q_rot.contiguous(), k_rot.contiguous(), cos, sin, at, self.rope_backend)
        else:
            q_rot, k_rot = rope(q_rot.contiguous(), k_rot.contiguous(), cos[:s], sin[:s], self.rope_backend)
        kv = self.kv_b_proj(kv).view(b, s, self.n_heads, self.nope + self.v).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.n_heads, -1, -1)], dim=-1)
        if docs is None and self.cache is not None:  # the heads' expanded keys and values are cached
            out = self.cache.attend(q, k, v.contiguous(), False, scale=self.scale)
        elif docs is None:  # SDPA takes values of their own width and the scale as is
            out = recompute.run(F.scaled_dot_product_attention, q, k, v.contiguous(), is_causal=True,
                                scale=self.scale, enabled=self.selective)
        else:
            out = self._packed(q, k, v, docs)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.v))

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Docs) -> torch.Tensor:
        """Packed documents or the context-parallel ring, whose kernels take one head width and
        the default scale: values (or q and k) zero-padded to a common width, q scaled by the ratio."""
        width = max(self.qk, self.v)
        q, k = F.pad(q, (0, width - self.qk)), F.pad(k, (0, width - self.qk))
        v = F.pad(v, (0, width - self.v))
        ratio = self.scale / width ** -0.5
        q = q if ratio == 1.0 else q * ratio
        if docs.cp is not None:
            out = ring_attention(q, k, v, docs.cp, None)
        else:
            out = recompute.run(attend, q, k, v, docs, None, False, enabled=self.selective)
        return out[..., :self.v]
