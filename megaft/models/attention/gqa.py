"""Grouped-query attention and its variants, read from ModelConfig (no per-family branches):

* q/k/v(/o) biases (`attention_bias`, Qwen2's `qkv_bias`);
* qk-norm (`qk_norm`, Qwen3): an RMSNorm over head_dim on q and k before RoPE, through
  the rmsnorm kernel front, its weight shared by all tp ranks' heads; with
  `qk_norm_width=full` (OLMoE) one RMSNorm over the whole q (k) projection, its sum of
  squares added over tp (megaft.layers.norm.WidthRMSNorm);
* sliding window (`sliding_window`, `layer_types`, Mistral/Qwen2): query i sees keys
  j with i - window < j <= i (transformers' sliding_window_overlay), a boolean mask
  for SDPA; RoPE goes through the rope kernel front either way;
* tp wider than the kv heads: kv heads replicated (megaft.models.attention.kv_heads);
* `query_pre_attn_scalar` (Gemma 2/3): the scores' scale, applied to q;
* `attn_softcap` (Gemma 2): soft-capped scores, explicit attention (megaft.models.attention.softcap);
* generation's KV cache (`cache`, set by megaft.inference.kv_cache while decoding; a prompt
  with images runs the `docs` path and fills it: megaft.inference.vision).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig, kv_replicas
from megaft.kernels.rope import rope
from megaft.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from megaft.layers.linear import column_outputs
from megaft.layers.norm import WidthRMSNorm
from megaft.models import recompute
from megaft.models.attention.documents import Docs, attend, kernel_name, rope_at
from megaft.models.attention.kv_heads import mark_replicated, replica_sum
from megaft.models.attention.softcap import softcap_attention
from megaft.parallel.comm import Group, group_size
from megaft.parallel.context.ring import ring_attention


def op_backend(kernels: Optional[KernelsConfig], op: str) -> str:
    """The kernel backend of `op` ("torch", the reference, without a kernels config)."""
    return "torch" if kernels is None else kernels.for_op(op)


def rope_positions(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, at: torch.Tensor,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k rotated at positions `at` of the tables: [seq] (every row alike: the chosen kernel), or
    [batch, seq] (left-padded rows decoding, megaft.inference.kv_cache: the torch form, whose
    tables broadcast over the heads; the kernels take one table for all rows)."""
    if at.dim() == 1:
        return rope(q, k, cos[at], sin[at], backend)
    return rope(q, k, cos[at].unsqueeze(1), sin[at].unsqueeze(1), "torch")


def window_mask(seq: int, window: Optional[int], device: torch.device) -> Optional[torch.Tensor]:
    """[seq, seq] boolean mask (True = attend) of causal attention limited to `window`
    keys; None when plain causal attention is the same thing (no window or window >= seq)."""
    if window is None or window >= seq:
        return None
    i = torch.arange(seq, device=device).unsqueeze(1)
    j = torch.arange(seq, device=device).unsqueeze(0)
    return (j <= i) & (j > i - window)


def attention_record(cfg: ModelConfig, *, packing: str, cp: int, seq_len: int, device: torch.device,
                     shared_prefix: bool = False) -> str:
    """What a run's attention computes with, for summary.json: `ring` under context
    parallelism (megaft.parallel.context.ring), the packed-documents kernel (`kernel_name`; rows
    with a `shared_prefix`, pref.share_prompt, never take flash-attn's varlen), SDPA with
    an explicit sliding-window mask when a layer's window is shorter than the sequence, the
    explicit soft-capped attention (`explicit_softcap`), or plain causal SDPA."""
    if cp > 1:
        return "ring"
    if cfg.attn_softcap is not None:
        return "explicit_softcap"
    if packing == "docs":
        return kernel_name(device, shared_prefix)
    windows = (cfg.window(layer) for layer in range(cfg.n_layers))
    return "sdpa_window_mask" if any(w is not None and w < seq_len for w in windows) else "sdpa_causal"


class Attention(nn.Module):
    """Each tp rank owns n_heads/tp query heads and the kv heads they read: n_kv_heads/tp,
    or one replicated kv head when tp > n_kv_heads. `layer` picks the block's window;
    `selective`: the attention core runs again in backward (recompute=selective); `overlap`:
    parallel.tp_overlap=ring (one ring for q/k/v, one for o: megaft.layers.linear)."""

    def __init__(self, cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
                 kernels: Optional[KernelsConfig] = None, layer: int = 0, selective: bool = False,
                 overlap: bool = False):
        super().__init__()
        tp, hd = group_size(group), cfg.hd
        self.group, self.sp, self.rope_backend = group, sequence_parallel, op_backend(kernels, "rope")
        self.replicas = kv_replicas(cfg, tp)
        self.n_heads, self.n_kv, self.hd = cfg.n_heads // tp, cfg.kv_heads * self.replicas // tp, hd
        self.window = cfg.window(layer)
        self.selective = selective
        self.cache = None  # a LayerCache while generating (megaft.inference.kv_cache.kv_cache)
        lin = op_backend(kernels, "linear")
        col = dict(group=group, bias=cfg.attention_bias or cfg.qkv_bias, sequence_parallel=sequence_parallel,
                   shared_input=True, backend=lin, overlap=overlap)
        self.q_proj = ColumnParallelLinear(cfg.dim, cfg.n_heads * hd, **col)
        # With replicas, k/v are built tp * hd wide (one head per rank) and re-marked as
        # replicated copies of the n_kv_heads * hd rows of the real tensor.
        self.k_proj = ColumnParallelLinear(cfg.dim, cfg.kv_heads * self.replicas * hd, **col)
        self.v_proj = ColumnParallelLinear(cfg.dim, cfg.kv_heads * self.replicas * hd, **col)
        if self.replicas > 1:
            for p in (self.k_proj.weight, self.k_proj.bias, self.v_proj.weight, self.v_proj.bias):
                if p is not None:
                    mark_replicated(p, cfg.kv_heads * hd, self.replicas)
        self.o_proj = RowParallelLinear(cfg.n_heads * hd, cfg.dim, group=group, bias=cfg.attention_bias,
                                        sequence_parallel=sequence_parallel, backend=lin, overlap=overlap)
        # query_pre_attn_scalar (Gemma 2/3): scores scaled by it ** -0.5, not head_dim ** -0.5; q is
        # multiplied by sqrt(head_dim / it) so every attention path (SDPA, documents, ring) keeps its scale
        qpas = cfg.query_pre_attn_scalar
        self.q_scale = math.sqrt(hd / qpas) if qpas is not None and qpas != hd else None
        self.softcap = cfg.attn_softcap  # Gemma 2: the explicit form (megaft.models.attention.softcap), cp refused
        self.q_norm = self.k_norm = None
        self.full_qk_norm = cfg.qk_norm and cfg.qk_norm_width == "full"
        if self.full_qk_norm:  # OLMoE: over the whole q (k) projection, each rank's heads a slice of it
            self.q_norm = WidthRMSNorm(cfg.n_heads * hd, eps=cfg.norm_eps, group=group)
            self.k_norm = WidthRMSNorm(cfg.kv_heads * hd, eps=cfg.norm_eps, group=group)
        elif cfg.qk_norm:
            norm = dict(eps=cfg.norm_eps, backend=op_backend(kernels, "rmsnorm"), offset=cfg.norm_offset,
                        group=group if tp > 1 else None)
            self.q_norm, self.k_norm = RMSNorm(hd, **norm), RMSNorm(hd, **norm)

    def _kv(self, proj: ColumnParallelLinear) -> Optional[tuple]:
        """None (the layer's own weights) or, with kv replicas, the (weight, bias) whose gradient
        is summed over the ranks sharing the head (megaft.models.attention.kv_heads)."""
        if self.replicas == 1:
            return None
        return replica_sum(proj.weight, self.group, self.replicas), replica_sum(proj.bias, self.group, self.replicas)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Docs] = None) -> torch.Tensor:
        """`docs`: packed documents kept apart (megaft.models.attention.documents), positions restarting
        in each; None = one causal sequence per row."""
        kv = [self._kv(self.k_proj), self._kv(self.v_proj)]
        x, (q, k, v) = column_outputs(x, [self.q_proj, self.k_proj, self.v_proj], [None, *kv])
        b, s, _ = x.shape
        v = v.view(b, s, self.n_kv, self.hd).transpose(1, 2)
        if self.full_qk_norm:
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        q, k = q.view(b, s, self.n_heads, self.hd), k.view(b, s, self.n_kv, self.hd)
        if self.q_norm is not None and not self.full_qk_norm:  # back to the projections' dtype (an fp32
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)  # weight promotes under autocast)
        if docs is not None:
            q, k = rope_at(q.transpose(1, 2), k.transpose(1, 2), cos, sin, docs, self.rope_backend)
            q = q if self.q_scale is None else q * self.q_scale
            if self.cache is not None:  # a prompt with images (megaft.inference.vision): cached as it is
                self.cache.extend(k, v)  # attended, with the images' mask; the new tokens follow causally
            if docs.cp is not None:  # context parallel: this rank's chunks, the ring over the cp group;
                # it keeps only q, k, v, out and the log-sum-exp: selective recompute has nothing to add
                out = ring_attention(q, k, v, docs.cp, self.window)
            elif self.softcap is not None:
                out = recompute.run(softcap_attention, q, k, v, docs.mask(self.window, False), self.softcap,
                                    enabled=self.selective)
            else:
                out = recompute.run(attend, q, k, v, docs, self.window, self.n_kv != self.n_heads,
                                    enabled=self.selective)
        elif self.cache is not None:  # generating (megaft.inference.kv_cache): only the new positions
            at = self.cache.positions(s, cos.shape[0], x.device)
            q, k = rope_positions(q.transpose(1, 2), k.transpose(1, 2), cos, sin, at, self.rope_backend)
            q = q if self.q_scale is None else q * self.q_scale
            out = self.cache.attend(q, k, v, self.n_kv != self.n_heads, self.window, softcap=self.softcap)
        else:
            q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos[:s], sin[:s], self.rope_backend)
            q = q if self.q_scale is None else q * self.q_scale
            mask = window_mask(s, self.window, x.device)
            if self.softcap is not None:
                out = recompute.run(softcap_attention, q, k, v, mask, self.softcap, enabled=self.selective)
            else:
                out = recompute.run(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, is_causal=mask is None,
                                    enable_gqa=self.n_kv != self.n_heads, enabled=self.selective)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.hd))
