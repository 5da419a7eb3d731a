"""Parallelism, one folder per concept (picotron's rule), over one grid of process groups.

- `grid`: `ParallelGrid`, every process group of a rank (tp fastest, then cp, dp, pp; ep
  inside the dp×cp replicas);
  `comm`: group helpers and plain collectives (`ParallelConfig`: megaft.config.parallel);
- `tensor/`: tensor and sequence parallelism (the autograd collectives, tp shard metadata);
- `context/`: context parallelism (the zig-zag token layout, a micro-batch's cp share,
  ring attention);
- `data/`: data parallelism (flat buffers, the bucketed gradient reduction and its
  compression; ZeRO, which shards the optimizer over the same replicas, is megaft.optim's);
- `expert/`: expert parallelism (tokens to their experts' ranks and back by all-to-all).

Pipeline parallelism is its own package, megaft.pipeline (schedules as data, their
validator and simulator, the stage model and the p2p runtime). Import the modules directly.
"""
