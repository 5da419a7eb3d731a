"""The part of the decoder (megaft.models.decoder) that one pipeline rank holds: its virtual stages' layers.

`StageModel` keeps the full model's parameter names (`embed_tokens.weight`,
`layers.<global index>.…`, `norm.weight`, `lm_head.weight`), so initialization
(seeded by name), HF loading and checkpoints treat it like a slice of `Decoder`.

Tied embeddings under pp > 1: the rank of the last virtual stage holds its own
`embed_tokens` copy used as the head weight (same name, hence the same init or HF
tensor as the first stage's). After each backward the two copies' gradients are
summed over the embedding group (first and last pp rank), as in Megatron, so the
copies stay identical; the copy on the last rank is left out of the grad norm.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from megaft.config.model import ModelConfig
from megaft.models.decoder import Decoder, rope_of
from megaft.parallel.comm import Group, all_reduce, group_size
from megaft.pipeline.partition import stage_layers


class StageModel(Decoder):
    """Virtual stages `pp_rank, pp_rank + pp, …` of the decoder, callable per stage."""

    def __init__(self, cfg: ModelConfig, *, pp: int, pp_rank: int, vpp: int = 1,
                 pp_layers: Optional[Sequence[int]] = None, group: Group = None, sequence_parallel: bool = False,
                 kernels=None, ep_group: Group = None, routing=None, tp_overlap: bool = False):
        n_stages = pp * vpp
        stages = list(range(pp_rank, n_stages, pp))
        ranges = stage_layers(cfg.n_layers, n_stages, pp_layers)
        is_first, is_last = 0 in stages, n_stages - 1 in stages
        tied_copy = cfg.tie_embeddings and not cfg.score_head and is_last and not is_first
        super().__init__(cfg, group=group, sequence_parallel=sequence_parallel, kernels=kernels,
                         layer_ids=[i for s in stages for i in ranges[s]], embedding=is_first or tied_copy,
                         head=is_last, keyed=True, stage_ranges=[ranges[s] for s in stages], ep_group=ep_group,
                         routing=routing, tp_overlap=tp_overlap)
        self.pp, self.pp_rank, self.n_stages = pp, pp_rank, n_stages
        self.last_stage, self.stages, self.stage_ranges = n_stages - 1, stages, ranges
        self.is_first, self.is_last, self.tied_copy = is_first, is_last, tied_copy

    def activation_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """Shape of the activations between stages for a [batch, seq] micro-batch."""
        if self.sp:
            tp = group_size(self.group)
            seq = (seq + (-seq % tp)) // tp
        return (batch, seq, self.cfg.dim)

    def forward(self, stage: int, x: torch.Tensor, labels: Optional[torch.Tensor] = None,
                docs=None, seq_len: Optional[int] = None, *,
                router_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stage `stage` on `x` (input ids on stage 0, activations otherwise); the last
        stage returns `Decoder.head_out`: the summed token loss against `labels` (as
        `Decoder.loss_sum`), or without labels the logits of this tp rank's vocabulary slice.
        `docs`: packed documents kept apart (megaft.models.attention.documents), the micro-batch's. The stage's
        MoE layers log their router statistics (`router_sums` reads them); `seq_len`: the
        micro-batch's length, for the sequence-parallel padding (default: stage 0's ids');
        `router_valid`: the micro-batch's [rows, seq_len] positions those statistics count (None: all)."""
        self.start_router_log(seq_len or x.shape[1], docs, router_valid)
        if stage == 0:
            x = self.embed(x, docs)
        docs = self.prepare_docs(docs)
        for i in self.stage_ranges[stage]:
            x = self.layers[str(i)](x, *rope_of(self, self.cfg, i), docs)
        return x if stage != self.last_stage else self.head_out(x, labels)

    def tied_weight(self) -> Optional[nn.Parameter]:
        """The tied embedding weight when this rank holds one of its two copies (pp > 1)."""
        if self.cfg.tie_embeddings and not self.cfg.score_head and self.pp > 1 and (self.is_first or self.is_last):
            return self.embed_tokens.weight
        return None

    def norm_params(self) -> list[nn.Parameter]:
        """Parameters counted in the grad norm: all but the last rank's tied copy."""
        skip = self.embed_tokens.weight if self.tied_copy else None
        return [p for p in self.parameters() if p.requires_grad and p is not skip]


@torch.no_grad()
def sync_tied_grads(model: StageModel, embedding_group: Group) -> None:
    """Sum the tied embedding's gradient over its two copies (first and last pp rank)."""
    weight = model.tied_weight()
    if weight is not None and weight.grad is not None:
        all_reduce(weight.grad, embedding_group)
