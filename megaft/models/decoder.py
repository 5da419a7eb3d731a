"""`Decoder`: the decoder-only transformer of every family, built from megaft.layers
(tensor parallel over `group`) and a ModelConfig that the family's ArchSpec filled.

Activations are [batch, seq, hidden]; with sequence parallel the residual stream
between blocks is a sequence shard [batch, seq / tp, hidden]. Parameter names
follow the Hugging Face layout (see megaft.models.hf) with `layers.N.` prefixes.

The block is Llama's; what other families change (biases, qk-norm, sliding window,
(1 + w) norms, scaled embeddings, GeGLU) is read from ModelConfig fields, set by the
family's spec in megaft.models.arch (attention variants: megaft.models.attention).
Activation checkpointing (`model.recompute`) is a constructor setting of each block,
passed on to its attention and MLP (megaft.models.recompute).

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

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig
from megaft.config.moe import MoEConfig
from megaft.kernels.cross_entropy import cross_entropy, linear_cross_entropy
from megaft.layers import ColumnParallelLinear, RMSNorm, VocabParallelEmbedding
from megaft.layers.dropout import sliced_dropout
from megaft.layers.linear import column_input
from megaft.models import recompute
from megaft.models.attention.documents import Docs
from megaft.models.attention.gqa import Attention, op_backend
from megaft.models.attention.mla import MLAttention
from megaft.models.attention.rope import rope_init, rope_tables
from megaft.models.attention.softcap import softcap
from megaft.models.mlp import MLP
from megaft.models.moe.layer import MoE
from megaft.models.moe.router import GlobalCounts, RouterLog, RouterLosses, RouterSums, router_losses, sum_records
from megaft.parallel.comm import Group, group_rank, group_size
from megaft.parallel.tensor.comm import gather_from_tp
from megaft.parallel.tensor.shard import mark_sequence_parallel


class Block(nn.Module):
    """Pre-norm decoder block `layer` (its index picks the attention window); `recompute`:
    what it recomputes in backward (megaft.models.recompute)."""

    def __init__(self, cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
                 kernels: Optional[KernelsConfig] = None, layer: int = 0, recompute: str = "none",
                 log: Optional[RouterLog] = None, ep_group: Group = None, routing: Optional[MoEConfig] = None,
                 tp_overlap: bool = False):
        super().__init__()
        self.dropout, self.full_recompute = cfg.dropout, recompute == "full"
        selective = recompute == "selective"  # the attention core and the MLP activation
        # Under sequence parallel this rank holds the tp_rank-th slice of the sequence (dim 1).
        self.seq_split = (group_rank(group), group_size(group)) if sequence_parallel else (0, 1)
        self.input_layernorm = make_norm(cfg, sequence_parallel=sequence_parallel, kernels=kernels)
        attention = MLAttention if cfg.mla else Attention  # multi-head latent attention (DeepSeek-V3)
        # tp_overlap (parallel.tp_overlap=ring): GQA and the dense MLP (megaft.validation refuses the rest)
        if tp_overlap and (cfg.mla or cfg.is_moe(layer)):
            raise ValueError("tp_overlap covers grouped-query attention and the dense MLP, not MLA or MoE layers")
        ring = dict(overlap=True) if tp_overlap else {}
        self.self_attn = attention(cfg, group=group, sequence_parallel=sequence_parallel, kernels=kernels,
                                   layer=layer, selective=selective, **ring)
        # post_attention_layernorm: the MLP's input norm, or with sandwich norms (Gemma 2/3, HF's names) the
        # attention output's, pre_feedforward_layernorm then being the MLP's input norm
        self.post_attention_layernorm = make_norm(cfg, sequence_parallel=sequence_parallel, kernels=kernels)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(cfg, sequence_parallel=sequence_parallel, kernels=kernels)
            self.post_feedforward_layernorm = make_norm(cfg, sequence_parallel=sequence_parallel, kernels=kernels)
        if cfg.is_moe(layer):  # a mixture of experts (megaft.models.moe) records its router statistics in `log`
            self.mlp = MoE(cfg, group=group, sequence_parallel=sequence_parallel, log=log or RouterLog(),
                           kernels=kernels, selective=selective, layer=layer, ep_group=ep_group, routing=routing)
        else:
            self.mlp = MLP(cfg, group=group, sequence_parallel=sequence_parallel, kernels=kernels,
                           selective=selective, **ring)

    def forward(self, x, cos, sin, docs=None):
        return recompute.run(self._forward, x, cos, sin, docs, enabled=self.full_recompute)

    def _forward(self, x, cos, sin, docs=None):
        h = self.self_attn(self.input_layernorm(x), cos, sin, docs)
        if self.sandwich:  # x + post_norm(attn), then x + post_ff_norm(mlp(pre_ff_norm(x)))
            h = self._drop(self.post_attention_layernorm(h)).to(x.dtype)
            normed, x = self.pre_feedforward_layernorm(h, residual=x)
            return x + self._drop(self.post_feedforward_layernorm(self.mlp(normed))).to(x.dtype)
        # The attention residual add is fused into the next norm: (norm(h + x), h + x). h is cast
        # to the residual stream's dtype first (bf16 under autocast, x fp32), as `x + h` would.
        h = self._drop(h).to(x.dtype)
        normed, x = self.post_attention_layernorm(h, residual=x)
        if self.dropout and self.training:  # dropout sits between the MLP and the add: no fusion
            return x + self._drop(self.mlp(normed))
        return self.mlp(normed, residual=x)  # x + mlp(normed)

    def _drop(self, h: torch.Tensor) -> torch.Tensor:
        """Residual dropout with the single process's mask at any tp (megaft.layers.dropout)."""
        if not (self.dropout and self.training):
            return h
        rank, n = self.seq_split
        return sliced_dropout(h, self.dropout, dim=1, size=h.shape[1] * n, start=rank * h.shape[1])


def make_norm(cfg: ModelConfig, *, sequence_parallel: bool, kernels: Optional[KernelsConfig] = None) -> RMSNorm:
    return RMSNorm(cfg.dim, eps=cfg.norm_eps, sequence_parallel=sequence_parallel,
                   backend=op_backend(kernels, "rmsnorm"), offset=cfg.norm_offset)


def make_embedding(cfg: ModelConfig, *, group: Group, sequence_parallel: bool) -> VocabParallelEmbedding:
    return VocabParallelEmbedding(cfg.vocab_size, cfg.dim, group=group, pad_to=cfg.make_vocab_size_divisible_by,
                                  sequence_parallel=sequence_parallel)


def make_head(cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
              kernels: Optional[KernelsConfig] = None) -> ColumnParallelLinear:
    """The vocabulary-parallel output projection, padded like the embedding."""
    return ColumnParallelLinear(cfg.dim, cfg.vocab_size, group=group, sequence_parallel=sequence_parallel,
                                pad_to=cfg.make_vocab_size_divisible_by, backend=op_backend(kernels, "linear"))


def make_score(cfg: ModelConfig, *, sequence_parallel: bool) -> nn.Linear:
    """A reward model's scalar head (HF *ForSequenceClassification's `score`, num_labels=1, no
    bias), whole on every tp rank. Under sequence parallel each rank scores its own tokens, so
    the weight's grad is a partial sum over tp (summed as the norms' are)."""
    score = nn.Linear(cfg.dim, 1, bias=False)
    if sequence_parallel:
        mark_sequence_parallel(score.weight)
    return score


def token_scores(h: torch.Tensor, score: nn.Linear, *, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """The scalar head at every position [batch, seq] of the final norm's output `h`; under sequence
    parallel gathered over tp (Megatron's gather without the reduce-scatter backward: every tp rank
    then computes the same loss, and each keeps the gradient of its own tokens)."""
    out = score(h).squeeze(-1)
    return gather_from_tp(out, group, dim=1) if sequence_parallel else out


def register_rope(module: nn.Module, cfg: ModelConfig) -> None:
    """cos/sin tables as non-persistent buffers (they follow .to(device), never saved); with
    `rope_local` also the sliding-window layers' own (rope_local_cos/sin)."""
    max_pos = cfg.extra.get("max_position_embeddings", cfg.max_seq_len)
    tables = {"rope": (cfg.rope_theta, cfg.rope_scaling)}
    if cfg.rope_local is not None:
        local = {k: v for k, v in cfg.rope_local.items() if k != "rope_theta"}
        tables["rope_local"] = (cfg.rope_local["rope_theta"], local if local.get("rope_type", "default") != "default"
                                else None)
    for name, (theta, scaling) in tables.items():
        inv, attention_factor = rope_init(cfg.hd, theta, scaling, max_pos)
        cos, sin = rope_tables(inv, cfg.max_seq_len, attention_factor)
        module.register_buffer(f"{name}_cos", cos, persistent=False)
        module.register_buffer(f"{name}_sin", sin, persistent=False)


def rope_of(module: nn.Module, cfg: ModelConfig, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of block `layer`: the local tables for a sliding-window layer under `rope_local`."""
    if cfg.rope_local is not None and cfg.window(layer) is not None:
        return module.rope_local_cos, module.rope_local_sin
    return module.rope_cos, module.rope_sin


def prepare_ids(input_ids: torch.Tensor, cfg: ModelConfig, *, group: Group, sequence_parallel: bool,
                packed: bool = False) -> torch.Tensor:
    """Check the length and, with sequence parallel, right-pad to a multiple of tp
    (sequence shards need seq % tp == 0; causal attention ignores right padding). A row of
    `packed` documents may be longer than max_seq_len: each document's positions start at 0
    (packed preference pairs: two answers of up to data.seq_len each)."""
    seq = input_ids.shape[1]
    if seq > cfg.max_seq_len and not packed:
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


class Decoder(nn.Module):
    """The decoder, or the part of it one rank holds, built one way for every layout and
    family: the embedding (`embedding`), the blocks `layer_ids` (global indices, so
    parameter names match the whole model's), and the final norm and head (`head`).

    By default it holds them all: `forward` returns this rank's vocabulary slice of the
    logits, [batch, seq, padded_vocab / tp], and `loss_sum` the summed token loss. A
    pipeline rank (megaft.pipeline.stage.StageModel) holds its stages' slice, with the
    blocks keyed by global index (`keyed`), and runs it stage by stage. `tp_overlap`
    (parallel.tp_overlap=ring, under sequence parallel): the blocks' sequence all-gathers and
    reduce-scatters run as rings beside their GEMMs (megaft.parallel.tensor.overlap)."""

    def __init__(self, cfg: ModelConfig, *, group: Group = None, sequence_parallel: bool = False,
                 kernels: Optional[KernelsConfig] = None, layer_ids=None, embedding: bool = True,
                 head: bool = True, keyed: bool = False, stage_ranges=None, ep_group: Group = None,
                 routing: Optional[MoEConfig] = None, tp_overlap: bool = False):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("ModelConfig.vocab_size must be resolved (from the tokenizer) before building")
        self.cfg, self.group, self.sp = cfg, group, sequence_parallel and group_size(group) > 1
        self.kernels = kernels  # KernelsConfig of the fused ops (None = the torch references)
        self.routing = routing or MoEConfig()  # moe.*: expert capacity, balancing scope (mixtures of experts)
        self.global_counts: Optional[GlobalCounts] = None  # moe.aux_scope=global_batch: set for each step
        layer_ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        # model.recompute applies to the first recompute_layers blocks of each pipeline stage
        again = recompute.recomputed_layers(stage_ranges or [layer_ids], cfg.recompute_layers)
        # Registration order (embedding, blocks, norm, head) is the flat buffers' layout order.
        if embedding:
            self.embed_tokens = make_embedding(cfg, group=group, sequence_parallel=self.sp)
        self.router_log = RouterLog()  # the MoE layers' statistics of the last forward
        self.token_groups: list = []  # the groups a micro-batch's tokens are split over (router statistics)
        blocks = {str(i): Block(cfg, group=group, sequence_parallel=self.sp, kernels=kernels, layer=i,
                                recompute=cfg.recompute if i in again else "none", log=self.router_log,
                                ep_group=ep_group, routing=routing, tp_overlap=tp_overlap and self.sp)
                  for i in layer_ids}
        self.layers = nn.ModuleDict(blocks) if keyed else nn.ModuleList(blocks.values())
        if head:
            self.norm = make_norm(cfg, sequence_parallel=self.sp, kernels=kernels)
            if cfg.score_head:  # a reward model (HF *ForSequenceClassification): no LM head, nothing to tie
                self.score = make_score(cfg, sequence_parallel=self.sp)
            else:
                self.lm_head = make_head(cfg, group=group, sequence_parallel=self.sp, kernels=kernels)
                if cfg.tie_embeddings:
                    self.lm_head.weight = self.embed_tokens.weight
        register_rope(self, cfg)

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this tp rank's slice of the head."""
        return group_rank(self.group) * self.lm_head.weight.shape[0]

    def embed(self, input_ids: torch.Tensor, docs: Optional[Docs] = None) -> torch.Tensor:
        """The embedding of `input_ids` (a sequence shard, right-padded, under sequence parallel),
        times sqrt(dim) with `scale_embeddings` (Gemma: the factor rounded to the weight's
        dtype first, as transformers does; the tied head uses the unscaled weight)."""
        x = self.embed_tokens(prepare_ids(input_ids, self.cfg, group=self.group, sequence_parallel=self.sp,
                                          packed=docs is not None))
        if self.cfg.scale_embeddings:
            x = x * torch.tensor(self.cfg.dim ** 0.5, dtype=self.embed_tokens.weight.dtype, device=x.device)
        return x

    def prepare_docs(self, docs: Optional[Docs]) -> Optional[Docs]:
        """`docs` on the activations' device, right-padded as `prepare_ids` pads the ids."""
        if docs is None:
            return None
        seq = docs.doc_ids.shape[1]
        tp = group_size(self.group) if self.sp else 1
        return docs.to(self.rope_cos.device).padded(seq + (-seq % tp))

    def head_out(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Final norm and head on the last block's output: the summed token loss against
        `labels` (see `token_loss_sum`; with kernels.fused_linear_cross_entropy the logits
        are never built whole), or without labels this tp rank's vocabulary slice of the
        logits (padded sequence under sequence parallel: the caller crops)."""
        h = self.norm(x)
        if self.cfg.score_head:
            return token_scores(h, self.score, group=self.group, sequence_parallel=self.sp)
        if labels is not None and self.kernels is not None and self.kernels.fused_linear_cross_entropy:
            return fused_head_loss_sum(h, self.lm_head, labels, vocab_size=self.cfg.vocab_size,
                                       kernels=self.kernels)
        logits = self.lm_head(h)
        if self.cfg.final_softcap is not None:  # Gemma 2 (the fused loss is refused with it: megaft.config)
            logits = softcap(logits, self.cfg.final_softcap)
        if labels is None:
            return logits
        return token_loss_sum(logits[:, :labels.shape[1]], labels, group=self.group,
                              vocab_size=self.cfg.vocab_size, kernels=self.kernels)

    def blocks(self, input_ids: torch.Tensor, docs: Optional[Docs] = None, *,
               router_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The last block's output of the whole decoder; `docs`: packed documents kept apart
        (megaft.models.attention.documents); `router_valid`: the micro-batch's positions a mixture of experts'
        router statistics count (see `start_router_log`)."""
        self.start_router_log(input_ids.shape[1], docs, router_valid)
        x, docs = self.embed(input_ids, docs), self.prepare_docs(docs)
        for i, layer in enumerate(self.layers):
            x = layer(x, *rope_of(self, self.cfg, i), docs)
        return x

    def start_router_log(self, seq_len: int, docs: Optional[Docs] = None,
                         valid: Optional[torch.Tensor] = None) -> None:
        """Open the MoE statistics of a forward over a micro-batch of `seq_len` tokens per row
        (this rank's), and note the groups its tokens are split over: tp under sequence
        parallel, cp. `valid`: [batch, seq_len] True at the positions the statistics count
        (a preference batch's tokens, not the padding after each row, which transformers'
        attention_mask keeps out of load_balancing_loss_func); None: all."""
        self.router_log.start(seq_len, valid)
        self.token_groups = ([self.group] if self.sp else []) + (
            [docs.cp.group] if docs is not None and docs.cp is not None else [])

    def router_losses(self) -> Optional[RouterLosses]:
        """The load-balancing and z-losses of the last forward's micro-batch (megaft.models.moe);
        None without MoE layers. Collective over the groups its tokens are split over."""
        return router_losses(self.router_log.close(), self.cfg, self.token_groups, self.global_counts)

    @torch.no_grad()
    def router_counts(self, input_ids: torch.Tensor, docs: Optional[Docs] = None) -> torch.Tensor:
        """Top-k assignments per expert of a micro-batch, summed over the MoE layers and the ranks
        holding its tokens (fp32): a forward without the head (moe.aux_scope=global_batch)."""
        self.blocks(input_ids, docs)
        sums = self.router_sums()
        return sums.counts.sum(0) if sums is not None else torch.zeros(self.cfg.n_experts, device=input_ids.device)

    def router_sums(self) -> Optional[RouterSums]:
        """The last forward's statistics, for a pipeline stage that holds some of the MoE layers."""
        return sum_records(self.router_log.close(), self.token_groups)

    def forward(self, input_ids: torch.Tensor, docs: Optional[Docs] = None, *,
                router_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This tp rank's vocabulary slice of the logits; `router_valid`: as `blocks`'."""
        return self.head_out(self.blocks(input_ids, docs, router_valid=router_valid))[:, :input_ids.shape[1]]

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor, docs: Optional[Docs] = None) -> torch.Tensor:
        """Summed token loss of a micro-batch (see `token_loss_sum`)."""
        return self.head_out(self.blocks(input_ids, docs), labels)
