"""Pipeline bubbles: measured step times and bubbles next to the simulator and the formula.

    python -m benchmarks.pipeline [--stage sleep|matmul] [--forward-ms 20] [--backward-ms 40]
                                  [--repeats 3] [--pp 2 4] [--microbatches 4 8 16]
    python -m benchmarks.pipeline --simulate [--forward 1] [--backward 2] [--p2p 0]
                                             [--plot DIR]

Measured (the default): the real runtime on p CPU gloo ranks whose stages have a
fixed cost (see benchmarks/pipeline/measure.py): `--stage sleep` waits like a host
waiting on a GPU kernel (runs on any machine), `--stage matmul` computes (needs p
free cores). Columns: step time, measured bubble = 1 - ideal/measured, the
simulator's bubble (free p2p, the issue's target) and the formula's, as shares of
the total time, the measured-vs-simulator relative gap, the simulator again with
the measured costs and one-way p2p latency (what a loaded machine adds), and for
interleaved rows the speed-up over 1F1B at the same p and m.

Simulated (`--simulate`):
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

"""
from __future__ import annotations

import argparse
import os
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


def run_measured(args) -> int:
    """Measure every case on CPU gloo ranks and print it beside the simulator and the formula."""
    from benchmarks.pipeline.measure import measure, simulated

    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    print(f"stage={args.stage} ideal={args.ideal} forward={args.forward_ms}ms backward={args.backward_ms}ms "
          f"per rank slice, repeats={args.repeats}; cores available: {cores}, load average {load:.2f}")
    for p in args.pp:
        if args.stage == "matmul" and p > cores:
            print(f"WARNING: p={p} compute-bound ranks on {cores} cores time-share: the measured bubble is "
                  "meaningless; use --stage sleep", file=sys.stderr)
    head = (f"{'schedule':<12}{'p':>3}{'v':>3}{'m':>4}  {'step ms':>8}  {'measured':>8} {'sim':>7} {'formula':>7}"
            f"  {'rel gap':>7}  {'sim+p2p':>7}  {'vs 1f1b':>7}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    for p in args.pp:
        cases = [(name, v, m) for name, pp, v, m in cases_for(p, args.microbatches)]
        results = measure(p, cases, args)
        print(f"p={p}: measured one-way p2p latency {next(iter(results.values()))[3] * 1e6:.0f} us")
        for name, v, m in cases:
            step, bubble, scale, latency = results[(name, p, v, m)]
            sim = simulated(name, p, v, m, args.forward_ms, args.backward_ms)
            with_p2p = simulated(name, p, v, m, args.forward_ms * scale, args.backward_ms * scale, latency * 1e3)
            theory = formula(name, p, v, m)
            gap = (bubble - sim) / sim
            worst = max(worst, abs(gap))
            speedup = ""
            if name == "interleaved" and ("1f1b", p, 1, m) in results:
                speedup = f"{results[('1f1b', p, 1, m)][0] / step:>6.3f}x"
            print(f"{name:<12}{p:>3}{v:>3}{m:>4}  {step * 1e3:>8.1f}  {bubble:>8.4f} {sim:>7.4f} "
                  f"{theory / (1 + theory):>7.4f}  {gap:>+7.1%}  {with_p2p:>7.4f}  {speedup:>7}")
    print(f"largest |measured - sim| / sim: {worst:.1%} (target <= 10%)")
    return 0


def cases_for(p: int, microbatches) -> list[tuple[str, int, int, int]]:
    """The measured cases at p: GPipe, 1F1B and interleaved at v=1, interleaved at v=2."""
    return [(name, p, v, m) for v in CHUNKS for m in microbatches
            for name in (("gpipe", "1f1b") if v == 1 else ()) + ("interleaved",)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true", help="only simulate (no processes)")
    parser.add_argument("--stage", choices=("sleep", "matmul"), default="sleep",
                        help="how a measured stage spends its time (sleep: like a host waiting on a GPU)")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="measured: forward of one rank's slice")
    parser.add_argument("--backward-ms", type=float, default=40.0, help="measured: backward of one rank's slice")
    parser.add_argument("--ideal", choices=("unblocked", "compute"), default="unblocked",
                        help="measured: a rank's ideal time = time not blocked on peers, or its F/B time only")
    parser.add_argument("--repeats", type=int, default=3, help="measured: timed steps per case (median)")
    parser.add_argument("--pp", type=int, nargs="+", default=list(PPS), help="measured: pipeline sizes")
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(MICROBATCHES),
                        help="measured: micro-batch counts (multiples of every pp, for interleaved)")
    parser.add_argument("--forward", type=float, default=1.0, help="forward time of one rank's slice")
    parser.add_argument("--backward", type=float, default=2.0, help="backward time of one rank's slice")
    parser.add_argument("--p2p", type=float, default=0.0, help="latency of one send")
    parser.add_argument("--plot", type=Path, help="also write one timeline PNG per case here")
    args = parser.parse_args(argv)
    if not args.simulate:
        return run_measured(args)

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
