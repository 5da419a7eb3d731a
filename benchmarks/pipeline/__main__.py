"""Pipeline bubbles: each schedule's simulated bubble next to the textbook formula.

    python -m benchmarks.pipeline --simulate [--forward 1] [--backward 2] [--p2p 0]
                                             [--plot DIR]

For p in {2, 4}, m in {4, 8, 16} and v in {1, 2} it builds every schedule that
applies (GPipe and 1F1B at v=1, interleaved 1F1B at v=1 and 2), validates it,
replays it with `megaft.pipeline.simulate` and prints:

* bubble = idle time / ideal time (Narayanan et al. 2021), simulated and the
  formula: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) for interleaved;
* the same idle time as a share of the total time, 1 - C/(p*T);
* peak activations on rank 0, in micro-batch activations of one chunk.

A rank's whole model slice costs `--forward`/`--backward`; with v chunks each chunk
costs 1/v of it, which is what the interleaved formula assumes. The formulas hold
for free p2p only (`--p2p 0`); with latency the simulated bubble grows.

Measured CPU timings (step time of each schedule on gloo ranks with a stage of
fixed cost, and measured bubble = 1 - ideal/measured next to these columns) come
with the pipeline runtime (issue 3, part 3); this module only simulates for now.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaft.pipeline import Cost, build_schedule, simulate, validate

PPS, MICROBATCHES, CHUNKS = (2, 4), (4, 8, 16), (1, 2)


def cases():
    """(schedule, p, v, m) rows in print order."""
    for p in PPS:
        for v in CHUNKS:
            for m in MICROBATCHES:
                for name in (("gpipe", "1f1b") if v == 1 else ()) + ("interleaved",):
                    yield name, p, v, m


def formula(name: str, p: int, v: int, m: int) -> float:
    """Textbook bubble, idle over ideal time."""
    return (p - 1) / (v * m) if name == "interleaved" else (p - 1) / m


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true",
                        help="print simulated bubbles against theory (the only mode so far)")
    parser.add_argument("--forward", type=float, default=1.0, help="forward time of one rank's slice")
    parser.add_argument("--backward", type=float, default=2.0, help="backward time of one rank's slice")
    parser.add_argument("--p2p", type=float, default=0.0, help="latency of one send")
    parser.add_argument("--plot", type=Path, help="also write one timeline PNG per case here")
    args = parser.parse_args(argv)
    if not args.simulate:
        parser.error("measured CPU timings come with the pipeline runtime; use --simulate for now")

    print(f"costs per rank: forward={args.forward} backward={args.backward} p2p={args.p2p}")
    head = (f"{'schedule':<12}{'p':>3}{'v':>3}{'m':>4}   {'bubble sim':>10} {'formula':>8}"
            f"   {'of total sim':>12} {'formula':>8}   {'peak act r0':>11}")
    print(head)
    print("-" * len(head))
    for name, p, v, m in cases():
        schedule = build_schedule(name, p, m, v)
        validate(schedule, p, m, v)
        result = simulate(schedule, p, Cost.per_chunk(v, args.forward, args.backward, args.p2p))
        theory = formula(name, p, v, m)
        print(f"{name:<12}{p:>3}{v:>3}{m:>4}   {result.bubble_ratio:>10.4f} {theory:>8.4f}"
              f"   {result.bubble_fraction:>12.4f} {theory / (1 + theory):>8.4f}"
              f"   {result.peak_activations[0]:>11}")
        if args.plot:
            from megaft.pipeline.plot import plot_timeline
            args.plot.mkdir(parents=True, exist_ok=True)
            plot_timeline(result, args.plot / f"{name}_p{p}_v{v}_m{m}.png",
                          title=f"{name}, p={p}, v={v}, m={m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
