"""Context parallelism (`parallel.cp`): every sequence split over the cp ranks.

- `layout`: the zig-zag token layout (`chunk_index`: rank i holds chunks i and 2·cp-1-i)
  and `ContextShard`, which (query rank, key rank) pairs attend;
- `batch`: a micro-batch's cp share (`context_shard`: this rank's tokens of whole rows);
- `ring`: ring attention over the cp group, K/V travelling with asynchronous p2p.

Attention reaches the ring through the micro-batch's `Docs.cp` (megaft.models.attention);
the packed-document masks that are not cp-specific stay in megaft.models.attention.documents.
"""
from megaft.parallel.context.batch import context_shard
from megaft.parallel.context.layout import ContextShard, chunk_index
from megaft.parallel.context.ring import ring_attention

__all__ = ["ContextShard", "chunk_index", "context_shard", "ring_attention"]
