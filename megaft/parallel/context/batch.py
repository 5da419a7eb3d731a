"""The context-parallel share of a micro-batch: this cp rank's tokens of whole rows.

A micro-batch arrives as whole rows [batch, seq] on every rank of a cp group. Each rank
keeps its two zig-zag chunks of every row (megaft.parallel.context.layout) and the
`ContextShard` that lets the ring (megaft.parallel.context.ring) build any block's mask:
the rows' length and, with packed documents, their whole document ids.
"""
from __future__ import annotations

import torch

from megaft.parallel.comm import Group, group_rank, group_size
from megaft.parallel.context.layout import ContextShard, chunk_index


def context_shard(input_ids: torch.Tensor, labels: torch.Tensor, docs, group: Group
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ContextShard]:
    """(input_ids, labels, position_ids, doc_ids, shard): this cp rank's tokens of a
    micro-batch of whole rows [b, seq] (its two chunks), their positions for RoPE (global
    ones, or each document's own under packing) and document ids, and the ContextShard.
    `docs`: the rows' packed-document layout (megaft.models.attention.documents.Docs: its `position_ids`
    and `doc_ids`), None for one causal sequence per row. The caller wraps the last three
    into the micro-batch's Docs, which attention reads."""
    b, seq = input_ids.shape
    idx = chunk_index(seq, group_size(group), group_rank(group), input_ids.device)
    if docs is None:
        positions, doc_ids = idx.expand(b, -1), torch.zeros(b, idx.numel(), dtype=torch.long, device=input_ids.device)
        shard = ContextShard(group, seq)
    else:
        positions, doc_ids = docs.position_ids[:, idx], docs.doc_ids[:, idx]
        shard = ContextShard(group, seq, docs.doc_ids)
    return input_ids[:, idx], labels[:, idx], positions, doc_ids, shard
