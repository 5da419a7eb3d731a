"""Llama-style decoder built from megaft.layers (tensor parallel over `group`).

Activations are [batch, seq, hidden]; with sequence parallel the residual stream
between blocks is a sequence shard [batch, seq / tp, hidden]. Parameter names
follow the Hugging Face layout (see megaft.models.hf) with `layers.N.` prefixes.

RMSNorm (with the residual add fused in front of the post-attention norm), RoPE,
SwiGLU, the loss and the linears' GEMMs (kernels.linear: gate/up + SwiGLU in one GEMM,
the MLP residual add fused into down_proj at tp=1) go through the kernel fronts
(megaft.kernels) with the backend of `kernels` (a KernelsConfig, passed down
explicitly; None = the torch references).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megaft.kernels.config import KernelsConfig
from megaft.kernels.cross_entropy import cross_entropy, linear_cross_entropy
from megaft.kernels.linear import fused_gate_up
from megaft.kernels.linear.fused import fused_gate_up_swiglu
from megaft.kernels.rope import rope
from megaft.kernels.swiglu import swiglu
from megaft.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from megaft.layers.linear import column_input
from megaft.models.config import ModelConfig
from megaft.models.rope import inv_frequencies, rope_tables
from megaft.parallel.comm import Group, group_rank, group_size


def op_backend(kernels: Optional[KernelsConfig], op: str) -> str:
    """The kernel backend of `op` ("torch", the reference, without a kernels config)."""
    return "torch" if kernels is None else kernels.for_op(op)


class Attention(nn.Module):
    """Grouped-query attention; each tp rank owns n_heads/tp query and n_kv_heads/tp kv heads."""

    def __init__(self, cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
                 kernels: Optional[KernelsConfig] = None):
        super().__init__()
        tp, hd = group_size(group), cfg.hd
        self.group, self.sp, self.rope_backend = group, sequence_parallel, op_backend(kernels, "rope")
        self.n_heads, self.n_kv, self.hd = cfg.n_heads // tp, cfg.kv_heads // tp, hd
        lin = op_backend(kernels, "linear")
        col = dict(group=group, bias=cfg.attention_bias, sequence_parallel=sequence_parallel, shared_input=True,
                   backend=lin)
        self.q_proj = ColumnParallelLinear(cfg.dim, cfg.n_heads * hd, **col)
        self.k_proj = ColumnParallelLinear(cfg.dim, cfg.kv_heads * hd, **col)
        self.v_proj = ColumnParallelLinear(cfg.dim, cfg.kv_heads * hd, **col)
        self.o_proj = RowParallelLinear(cfg.n_heads * hd, cfg.dim, group=group, bias=cfg.attention_bias,
                                        sequence_parallel=sequence_parallel, backend=lin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = column_input(x, self.group, self.sp)
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.hd).transpose(1, 2)
        q, k = rope(q, k, cos[:s], sin[:s], self.rope_backend)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up split by columns, down by rows."""

    def __init__(self, cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
                 kernels: Optional[KernelsConfig] = None):
        super().__init__()
        self.group, self.sp, self.swiglu_backend = group, sequence_parallel, op_backend(kernels, "swiglu")
        lin = op_backend(kernels, "linear")
        col = dict(group=group, bias=cfg.mlp_bias, sequence_parallel=sequence_parallel, shared_input=True,
                   backend=lin)
        self.gate_proj = ColumnParallelLinear(cfg.dim, cfg.ffn_dim, **col)
        self.up_proj = ColumnParallelLinear(cfg.dim, cfg.ffn_dim, **col)
        self.down_proj = RowParallelLinear(cfg.ffn_dim, cfg.dim, group=group, bias=cfg.mlp_bias,
                                           sequence_parallel=sequence_parallel, backend=lin)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """down(...) (+ residual: down_proj fuses the add where exact, see RowParallelLinear)."""
        x = column_input(x, self.group, self.sp)
        gate, up = self.gate_proj, self.up_proj
        if fused_gate_up(gate.backend, x.device):  # one GEMM reads both weights, SwiGLU in its epilogue
            h = fused_gate_up_swiglu(x, gate.weight, up.weight, gate.bias, up.bias)
        else:
            h = swiglu(gate(x), up(x), self.swiglu_backend)
        return self.down_proj(h, residual)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
                 kernels: Optional[KernelsConfig] = None):
        super().__init__()
        self.dropout = cfg.dropout
        self.input_layernorm = make_norm(cfg, sequence_parallel=sequence_parallel, kernels=kernels)
        self.self_attn = Attention(cfg, group=group, sequence_parallel=sequence_parallel, kernels=kernels)
        self.post_attention_layernorm = make_norm(cfg, sequence_parallel=sequence_parallel, kernels=kernels)
        self.mlp = MLP(cfg, group=group, sequence_parallel=sequence_parallel, kernels=kernels)

    def forward(self, x, cos, sin):
        h = self.self_attn(self.input_layernorm(x), cos, sin)
        # The attention residual add is fused into the next norm: (norm(h + x), h + x). h is cast
        # to the residual stream's dtype first (bf16 under autocast, x fp32), as `x + h` would.
        h = F.dropout(h, self.dropout, self.training).to(x.dtype)
        normed, x = self.post_attention_layernorm(h, residual=x)
        if self.dropout and self.training:  # dropout sits between the MLP and the add: no fusion
            return x + F.dropout(self.mlp(normed), self.dropout, self.training)
        return self.mlp(normed, residual=x)  # x + mlp(normed)


def make_norm(cfg: ModelConfig, *, sequence_parallel: bool, kernels: Optional[KernelsConfig] = None) -> RMSNorm:
    return RMSNorm(cfg.dim, eps=cfg.norm_eps, sequence_parallel=sequence_parallel,
                   backend=op_backend(kernels, "rmsnorm"))


def make_embedding(cfg: ModelConfig, *, group: Group, sequence_parallel: bool) -> VocabParallelEmbedding:
    return VocabParallelEmbedding(cfg.vocab_size, cfg.dim, group=group, pad_to=cfg.make_vocab_size_divisible_by,
                                  sequence_parallel=sequence_parallel)


def make_head(cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
              kernels: Optional[KernelsConfig] = None) -> ColumnParallelLinear:
    """The vocabulary-parallel output projection, padded like the embedding."""
    return ColumnParallelLinear(cfg.dim, cfg.vocab_size, group=group, sequence_parallel=sequence_parallel,
                                pad_to=cfg.make_vocab_size_divisible_by, backend=op_backend(kernels, "linear"))


def register_rope(module: nn.Module, cfg: ModelConfig) -> None:
    """cos/sin tables as non-persistent buffers (they follow .to(device), never saved)."""
    cos, sin = rope_tables(inv_frequencies(cfg.hd, cfg.rope_theta, cfg.rope_scaling), cfg.max_seq_len)
    module.register_buffer("rope_cos", cos, persistent=False)
    module.register_buffer("rope_sin", sin, persistent=False)


def prepare_ids(input_ids: torch.Tensor, cfg: ModelConfig, *, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Check the length and, with sequence parallel, right-pad to a multiple of tp
    (sequence shards need seq % tp == 0; causal attention ignores right padding)."""
    seq = input_ids.shape[1]
    if seq > cfg.max_seq_len:
        raise ValueError(f"sequence of {seq} tokens exceeds model.max_seq_len={cfg.max_seq_len}")
    pad = -seq % group_size(group) if sequence_parallel else 0
    return F.pad(input_ids, (0, pad)) if pad else input_ids


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, *, group: Group, vocab_size: int,
                   kernels: Optional[KernelsConfig] = None) -> torch.Tensor:
    """Sum over target tokens (labels != -100) of the cross-entropy of this rank's
    vocabulary slice of the logits [batch, seq, V/tp], fp32.

    Callers divide by the target count of the whole global batch, which keeps the
    token-weighted mean exact however the batch is split into micro-batches."""
    local = logits.shape[-1]
    losses = cross_entropy(logits.reshape(-1, local), labels.reshape(-1), group=group,
                           vocab_start=group_rank(group) * local, vocab_size=vocab_size,
                           backend=op_backend(kernels, "cross_entropy"))
    return losses.sum()


def fused_head_loss_sum(hidden: torch.Tensor, head: ColumnParallelLinear, labels: torch.Tensor, *,
                        vocab_size: int, kernels: KernelsConfig) -> torch.Tensor:
    """`token_loss_sum(head(hidden), labels)` without the logits of the whole micro-batch:
    the head's projection and the loss run `kernels.ce_chunk_tokens` tokens at a time
    (megaft.kernels.cross_entropy.linear_cross_entropy). `hidden` is the final norm's
    output (a sequence shard under sequence parallel, gathered here as the head would)."""
    if head.bias is not None:
        raise ValueError("the fused linear cross-entropy supports a head without bias only")
    h = column_input(hidden, head.group, head.sequence_parallel)[:, :labels.shape[1]]
    local = head.weight.shape[0]
    losses = linear_cross_entropy(h.reshape(-1, h.shape[-1]), head.weight, labels.reshape(-1), group=head.group,
                                  vocab_start=group_rank(head.group) * local, vocab_size=vocab_size,
                                  backend=op_backend(kernels, "cross_entropy"), chunk=kernels.ce_chunk_tokens)
    return losses.sum()


class Llama(nn.Module):
    """The decoder. `forward` returns this rank's vocabulary slice of the logits,
    [batch, seq, padded_vocab / tp]; `loss_sum` the summed token loss."""

    def __init__(self, cfg: ModelConfig, *, group: Group = None, sequence_parallel: bool = False,
                 kernels: Optional[KernelsConfig] = None):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("ModelConfig.vocab_size must be resolved (from the tokenizer) before building")
        self.cfg, self.group, self.sp = cfg, group, sequence_parallel and group_size(group) > 1
        self.kernels = kernels
        self.embed_tokens = make_embedding(cfg, group=group, sequence_parallel=self.sp)
        self.layers = nn.ModuleList(Block(cfg, group=group, sequence_parallel=self.sp, kernels=kernels)
                                    for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg, sequence_parallel=self.sp, kernels=kernels)
        self.lm_head = make_head(cfg, group=group, sequence_parallel=self.sp, kernels=kernels)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        register_rope(self, cfg)

    @property
    def vocab_start(self) -> int:
        return self.embed_tokens.vocab_start

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final norm's output (sequence-sharded and right-padded under sequence parallel)."""
        x = self.embed_tokens(prepare_ids(input_ids, self.cfg, group=self.group, sequence_parallel=self.sp))
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(input_ids))[:, :input_ids.shape[1]]

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token loss of a micro-batch (see `token_loss_sum`); with
        kernels.fused_linear_cross_entropy the logits are never built whole."""
        if self.kernels is not None and self.kernels.fused_linear_cross_entropy:
            return fused_head_loss_sum(self.hidden(input_ids), self.lm_head, labels,
                                       vocab_size=self.cfg.vocab_size, kernels=self.kernels)
        return token_loss_sum(self(input_ids), labels, group=self.group, vocab_size=self.cfg.vocab_size,
                              kernels=self.kernels)
