"""Expert parallelism (`parallel.ep`): the routed experts of a mixture of experts split over
ep ranks taken from the dp×cp replicas (megaft.parallel.grid: `ep_group`,
`expert_replica_group`).

- `dispatch`: tokens to their experts' ranks and back by all-to-all (autograd-aware), the
  exchanged rows grouped by local expert for the grouped GEMM.

Which experts a weight holds is its `ExpertSlice` (megaft.parallel.tensor.shard), read by
init, HF import/export and checkpoints; expert gradients reduce over
`expert_replica_group` (megaft.parallel.data).
"""
from megaft.parallel.expert.dispatch import all_to_all, dispatch_compute_combine

__all__ = ["all_to_all", "dispatch_compute_combine"]
