"""VocabParallelEmbedding: the vocabulary (rows) split over tp ranks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.model import padded_size
from megaft.parallel.comm import Group, group_rank, group_size
from megaft.parallel.tensor.comm import reduce_from_tp, reduce_scatter_to_sp
from megaft.parallel.tensor.shard import mark_sharded


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its vocabulary range, zeros the rest, and the
    partial rows are summed over tp (all-reduce, or reduce-scatter along the sequence
    with sequence parallel). The vocabulary is padded to a multiple of `pad_to * tp`;
    padded rows are never looked up because ids < num_embeddings."""

    def __init__(self, num_embeddings: int, dim: int, *, group: Group, pad_to: int = 1,
                 sequence_parallel: bool = False):
        super().__init__()
        tp = group_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.dim = num_embeddings, dim
        self.padded = padded_size(num_embeddings, pad_to * tp)
        local = self.padded // tp
        self.vocab_start = group_rank(group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = mark_sharded(nn.Parameter(torch.empty(local, dim)), 0, num_embeddings, self.padded)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group)
        return reduce_from_tp(out, self.group)
