"""Parallelism, one folder per concept (picotron's rule), over one grid of process groups.

- `grid`: `ParallelGrid`, every process group of a rank (tp fastest, then cp, dp, pp; ep
  inside the dp×cp replicas);
  `config`: `ParallelConfig` and its checks; `comm`: group helpers and plain collectives;
- `tensor/`: tensor and sequence parallelism (the autograd collectives, tp shard metadata);
- `context/`: context parallelism (the zig-zag token layout, a micro-batch's cp share,
  ring attention);
- `data/`: data parallelism and ZeRO 1-3 (flat buffers, bucketed gradient reduction and
  its compression, the sharded optimizer state, per-layer parameter gathering);
- `expert/`: expert parallelism (tokens to their experts' ranks and back by all-to-all).

Pipeline parallelism is its own package, megaft.pipeline (schedules as data, their
validator and simulator, the stage model and the p2p runtime).
"""
from megaft.config.parallel import ParallelConfig, check_parallel
from megaft.parallel.grid import Axis, ParallelGrid

__all__ = ["Axis", "ParallelConfig", "ParallelGrid", "check_parallel"]
