"""The part of the Llama that one pipeline rank holds: its virtual stages' layers.

`StageModel` keeps the full model's parameter names (`embed_tokens.weight`,
`layers.<global index>.…`, `norm.weight`, `lm_head.weight`), so initialization
(seeded by name), HF loading and checkpoints treat it like a slice of `Llama`.

Tied embeddings under pp > 1: the rank of the last virtual stage holds its own
`embed_tokens` copy used as the head weight (same name, hence the same init or HF
tensor as the first stage's). After each backward the two copies' gradients are
summed over the embedding group (first and last pp rank), as in Megatron, so the
copies stay identical; the copy on the last rank is left out of the grad norm.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megaft.models.config import ModelConfig
from megaft.models.llama import (
    Block, fused_head_loss_sum, make_embedding, make_head, make_norm, prepare_ids, register_rope, token_loss_sum,
)
from megaft.parallel.comm import Group, all_reduce, group_rank, group_size
from megaft.pipeline.partition import stage_layers


class StageModel(nn.Module):
    """Virtual stages `pp_rank, pp_rank + pp, …` of the decoder, callable per stage."""

    def __init__(self, cfg: ModelConfig, *, pp: int, pp_rank: int, vpp: int = 1,
                 pp_layers: Optional[Sequence[int]] = None, group: Group = None, sequence_parallel: bool = False,
                 kernels=None):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("ModelConfig.vocab_size must be resolved (from the tokenizer) before building")
        self.cfg, self.group, self.sp = cfg, group, sequence_parallel and group_size(group) > 1
        self.kernels = kernels  # KernelsConfig of the fused ops (None = torch), as Llama's
        self.pp, self.pp_rank, self.n_stages = pp, pp_rank, pp * vpp
        self.last_stage = self.n_stages - 1
        self.stages = list(range(pp_rank, self.n_stages, pp))
        self.stage_ranges = stage_layers(cfg.n_layers, self.n_stages, pp_layers)
        self.is_first, self.is_last = 0 in self.stages, self.last_stage in self.stages
        self.tied_copy = cfg.tie_embeddings and self.is_last and not self.is_first
        if self.is_first or self.tied_copy:  # registered first so the tied weight keeps this name
            self.embed_tokens = make_embedding(cfg, group=group, sequence_parallel=self.sp)
        self.layers = nn.ModuleDict({str(i): Block(cfg, group=group, sequence_parallel=self.sp, kernels=kernels)
                                     for s in self.stages for i in self.stage_ranges[s]})
        if self.is_last:
            self.norm = make_norm(cfg, sequence_parallel=self.sp, kernels=kernels)
            self.lm_head = make_head(cfg, group=group, sequence_parallel=self.sp, kernels=kernels)
            if cfg.tie_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        register_rope(self, cfg)

    def activation_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """Shape of the activations between stages for a [batch, seq] micro-batch."""
        if self.sp:
            tp = group_size(self.group)
            seq = (seq + (-seq % tp)) // tp
        return (batch, seq, self.cfg.dim)

    def forward(self, stage: int, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stage `stage` on `x` (input ids on stage 0, activations otherwise); the last
        stage returns the summed token loss against `labels` (as `Llama.loss_sum`), or
        without labels this tp rank's vocabulary slice of the logits (padded sequence
        under sequence parallel: the caller crops to its length)."""
        if stage == 0:
            x = self.embed_tokens(prepare_ids(x, self.cfg, group=self.group, sequence_parallel=self.sp))
        for i in self.stage_ranges[stage]:
            x = self.layers[str(i)](x, self.rope_cos, self.rope_sin)
        if stage != self.last_stage:
            return x
        if labels is not None and self.kernels is not None and self.kernels.fused_linear_cross_entropy:
            return fused_head_loss_sum(self.norm(x), self.lm_head, labels, vocab_size=self.cfg.vocab_size,
                                       kernels=self.kernels)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        logits = logits[:, :labels.shape[1]]
        return token_loss_sum(logits, labels, group=self.group, vocab_size=self.cfg.vocab_size, kernels=self.kernels)

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this tp rank's slice of the head (last stage)."""
        return group_rank(self.group) * self.lm_head.weight.shape[0]

    def tied_weight(self) -> Optional[nn.Parameter]:
        """The tied embedding weight when this rank holds one of its two copies (pp > 1)."""
        if self.cfg.tie_embeddings and self.pp > 1 and (self.is_first or self.is_last):
            return self.embed_tokens.weight
        return None

    def norm_params(self) -> list[nn.Parameter]:
        """Parameters counted in the grad norm: all but the last rank's tied copy."""
        skip = self.embed_tokens.weight if self.tied_copy else None
        return [p for p in self.parameters() if p.requires_grad and p is not skip]


def build_embedding_group(grid) -> Group:
    """The group {first pp rank, last pp rank} of this rank's (dp, tp) position, or None
    when pp == 1. Collective: every rank must call it, in the same order."""
    if grid.pp_size == 1:
        return None
    inner = grid.tp_size * grid.dp_size
    mine = None
    for pos in range(inner):
        members = [pos, (grid.pp_size - 1) * inner + pos]
        group = dist.new_group(members, timeout=grid.timeout)
        if grid.rank in members:
            mine = group
    return mine


@torch.no_grad()
def sync_tied_grads(model: StageModel, embedding_group: Group) -> None:
    """Sum the tied embedding's gradient over its two copies (first and last pp rank)."""
    weight = model.tied_weight()
    if weight is not None and weight.grad is not None:
        all_reduce(weight.grad, embedding_group)
