"""Data parallelism and ZeRO: every replica's gradients summed, optionally its state sharded.

- `flat`: `FlatParams`, parameters and gradients as views into contiguous buffers cut
  into buckets, padded so ZeRO splits each bucket into dp equal chunks;
- `buckets`: `GradReducer`, the bucketed reduction launched from autograd hooks during
  backward (all-reduce, or reduce-scatter onto the owned chunks);
- `compress`: bf16 and PowerSGD compression of that reduction;
- `zero`: ZeRO stages 1-2 (`ShardedAdamW`: AdamW state of the owned chunks) and
  `build_optimizer`, which builds one rank's buffers, optimizer and reducer for any stage;
- `zero3`: ZeRO stage 3, each layer's parameters gathered only while it runs.

The replicas are the dp×cp ranks holding the same parameters (`grid.replica_group`).
The AdamW math the stages share stays in megaft.optim (`adamw_update_`, host offload).
"""
from megaft.parallel.data.buckets import GradReducer
from megaft.parallel.data.flat import FlatParams
from megaft.parallel.data.zero import ShardedAdamW, build_optimizer

__all__ = ["FlatParams", "GradReducer", "ShardedAdamW", "build_optimizer"]
