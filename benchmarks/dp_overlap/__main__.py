"""Fraction of the dp gradient reduction hidden behind backward, on CPU gloo ranks.

    python -m benchmarks.dp_overlap [--dp 2] [--dim 512] [--layers 8] [--bucket-mb 4 25 1000]
                                    [--batch 1] [--seq 64] [--repeats 7]
                                    [--compression none bf16 powersgd] [--powersgd-rank 2]

For each bucket size, every rank of a `dp`-rank gloo world times (median of
`--repeats`, after one warmup) on a Llama of the given width and depth:

  backward     forward + backward alone (no reduction)
  reduce       the bucketed all-reduce alone, after backward (GradReducer.finish)
  sequential   backward, then the reduction (hooks off: what plain dp does)
  overlapped   backward with the hooks launching each bucket as it fills, then the
               wait for the last ones (megaft.parallel.data.buckets)

Each bucket size is measured once per `--compression` (megaft.parallel.data.compress);
sent_MiB is what one rank hands to the collectives per reduction (GradReducer's
byte counter), so the rows compare bytes and time of none, bf16 and PowerSGD.

hidden = (backward + reduce - overlapped) / reduce: the share of the reduction's time
that ran while backward was still computing (1.0 = all of it, 0 = none). One bucket
(a huge --bucket-mb) can only start when backward is over, so its row is the
reference measured in the same run. Each rank uses one compute thread; gloo's
transport thread needs a spare core to overlap, so on a loaded 2-core box the
numbers are noisy and low.
"""
from __future__ import annotations

import argparse

from benchmarks.dp_overlap.measure import model_of, run_rank
from benchmarks.ranks import on_gloo_ranks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[1000.0, 25.0, 4.0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--compression", nargs="+", default=["none"], choices=["none", "bf16", "powersgd"])
    p.add_argument("--powersgd-rank", type=int, default=2)
    args = p.parse_args()
    rows = on_gloo_ranks(args.dp, run_rank, args)
    params = sum(p.numel() for p in model_of(args).parameters())
    print(f"dp={args.dp} gloo CPU ranks, Llama dim={args.dim} layers={args.layers}: {params / 1e6:.1f}M params, "
          f"{params * 4 / 2 ** 20:.0f} MiB fp32 grads, batch {args.batch}x{args.seq}, median of {args.repeats}")
    print(f"{'bucket_mb':>9} {'compression':>11} {'buckets':>7} {'sent_MiB':>8} {'backward_ms':>11} "
          f"{'reduce_ms':>9} {'sequential_ms':>13} {'overlapped_ms':>13} {'hidden':>6} {'speedup':>7}")
    for mb, comp, n, bwd, red, seq, over, sent in rows:
        hidden = (bwd + red - over) / red
        print(f"{mb:>9g} {comp:>11} {n:>7} {sent:>8.2f} {bwd * 1e3:>11.1f} {red * 1e3:>9.1f} {seq * 1e3:>13.1f} "
              f"{over * 1e3:>13.1f} {hidden:>6.2f} {seq / over:>6.2f}x")


if __name__ == "__main__":
    main()
