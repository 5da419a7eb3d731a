"""A step of megaft against TRL's on the same inputs, timed in interleaved rounds (benchmarks.rl,
benchmarks.distill): the variants' curves are checked to agree first, every timed turn is checked
against that curve again (a turn that drifted has no valid time), and the medians print as ratios
to TRL's."""
from __future__ import annotations

import os
import statistics
import sys
from typing import Callable

from benchmarks.kernels.harness import quantile
from benchmarks.train_step.measure import round_orders, split_steps


def curve_disagreements(turns: dict, steps: int, rtol: float, floor: float = 0.0) -> list[str]:
    """Where a variant's first `steps` losses or its step-1 grad norm differ from megaft's by more than
    `rtol` relative (of at least `floor`: a loss near 0 needs an absolute one)."""
    want, bad = turns["megaft"], []
    for name, got in turns.items():
        if len(got.losses) < steps:
            bad.append(f"{name}: {len(got.losses)} steps logged, {steps} expected")
            continue
        for i in range(steps):
            compared = [("loss", got.losses[i], want.losses[i])] + (
                [("grad_norm", got.grad_norms[0], want.grad_norms[0])] if i == 0 else [])
            for what, g, w in compared:
                if abs(g - w) > rtol * max(abs(w), floor):
                    bad.append(f"{name} step {i + 1} {what}: {g:.8f} against megaft's {w:.8f}")
    return bad


def check_agreement(checked: dict, disagreements: Callable, steps: int) -> None:
    """Print each variant's losses / grad norms; exit 1 when they disagree (no timing is valid)."""
    for v, t in checked.items():
        print(f"  {v:<7} " + "  ".join(f"{x:.8f} / {n:.6f}" for x, n in zip(t.losses, t.grad_norms)))
    bad = disagreements(checked, steps)
    if bad:
        print("the variants disagree; no timing is valid:\n  " + "\n  ".join(bad))
        sys.exit(1)


def time_in_rounds(variants: list[str], run_turn: Callable, disagreements: Callable, checked: dict, a) -> dict:
    """Each variant's turns (`run_turn(variant, steps)`, warm-up steps dropped) over `a.rounds`
    interleaved rounds of `a.steps` timed steps in all; each turn checked against `checked["megaft"]`."""
    turns: dict[str, list] = {v: [] for v in variants}
    for order, n in zip(round_orders(list(variants), a.rounds), split_steps(a.steps, a.rounds)):
        for v in order:
            turn = run_turn(v, a.warmup + n)
            bad = disagreements({"megaft": checked["megaft"], v: turn}, min(a.check, a.warmup + n))
            if bad:
                print(f"a {v} turn left the checked curve:\n  " + "\n  ".join(bad))
                sys.exit(1)
            turn.times = turn.times[a.warmup:]
            turns[v].append(turn)
    return turns


def report_vs_trl(turns: dict, steps: int, load_start: float) -> tuple[dict, float]:
    """Each variant's median step (and p20-p80) and its ratio to TRL's, printed; (rows, load at the end)."""
    rows = {}
    for v, vt in turns.items():
        times = [t for turn in vt for t in turn.times]
        rows[v] = {"step_ms": 1e3 * statistics.median(times), "p20_ms": 1e3 * quantile(times, 0.2),
                   "p80_ms": 1e3 * quantile(times, 0.8), "steps": len(times)}
    for row in rows.values():
        row["vs_trl"] = row["step_ms"] / rows["trl"]["step_ms"]
    print(f"\n{'variant':<8} {'step_ms':>9} {'p20-p80':>13} {'vs trl':>8}")
    for v, row in rows.items():
        print(f"{v:<8} {row['step_ms']:>9.1f} {row['p20_ms']:>6.0f}-{row['p80_ms']:<6.0f} {row['vs_trl']:>7.3f}x")
    load_end = os.getloadavg()[0]
    print(f"medians over {steps} timed steps a variant; load average {load_start:.2f} at the start, "
          f"{load_end:.2f} at the end")
    return rows, load_end
