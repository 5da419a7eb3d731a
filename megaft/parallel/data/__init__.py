"""Data parallelism: every replica's gradients summed, in buckets, during backward.

- `flat`: `FlatParams`, parameters and gradients as views into contiguous buffers cut
  into buckets, padded so ZeRO splits each bucket into dp equal chunks;
- `buckets`: `GradReducer`, the bucketed reduction launched from autograd hooks during
  backward (all-reduce, or reduce-scatter onto the owned chunks);
- `compress`: bf16 and PowerSGD compression of that reduction;

The replicas are the dp×cp ranks holding the same parameters (`grid.replica_group`).
ZeRO, which shards the optimizer over them, is the optimizer's (megaft.optim.zero, zero3):
above this folder, as Megatron keeps its distributed optimizer beside the others.
"""
from megaft.parallel.data.buckets import GradReducer
from megaft.parallel.data.flat import FlatParams

__all__ = ["FlatParams", "GradReducer"]
