"""Tensor parallelism (`parallel.tp`) and sequence parallelism (`parallel.sequence_parallel`).

- `comm`: the autograd-aware collectives, named by their forward/backward pair
  (Megatron's f = `copy_to_tp`, g = `reduce_from_tp`, and the sequence-parallel pair);
- `shard`: how a parameter is split over the tp ranks (`TPShard`), read by init, HF
  import/export, clipping and checkpoints;
- `grads`: the sequence-parallel gradient sum over tp after backward.

The layers built on them (column/row-parallel linears, the vocabulary-parallel
embedding, RMSNorm) are in megaft.layers; they take the tp `group`, never the grid.
"""
