"""Muon against AdamW on the same data: the step at which each first reaches the AdamW run's loss
(issue 41), each optimizer at its best learning rate of a small sweep.

    python -m benchmarks.optim_race [--dim D] [--layers L] [--heads H] [--ffn F] [--task T]
                                    [--steps N] [--batch B] [--adamw-lrs a,b,...] [--muon-lrs a,b,...]
                                    [--window W] [--every K]

Every run is megaft's Trainer on one process (fp32, CPU), the same model init, the same generated
task and the same batches in the same order; only optim.name and optim.lr differ. Muon runs with
optim.muon.scale=match_rms_adamw (Moonlight's rule: its update's RMS matches AdamW's, so one lr
serves the Muon matrices and the AdamW tensors beside them, the embedding, head and norms), both
with the default warmup, cosine decay and weight decay. A curve is the training loss smoothed by a
trailing mean over --window steps (one step's batch is noisy). For each optimizer the best lr is
the one with the lowest final smoothed loss; the target is the best AdamW run's final smoothed
loss, and the race is the first step at which each best run's smoothed loss reaches it. Prints
every run's curve every --every steps, then the race.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import resolve


def config(args, name: str, lr: float) -> Config:
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.ffn_dim = args.dim, args.layers, args.heads, args.ffn
    cfg.data.task, cfg.data.seq_len, cfg.data.task_eval_size = args.task, args.seq_len, 0
    t = cfg.train
    t.max_steps, t.micro_batch_size, t.global_batch_size = args.steps, args.batch, args.batch
    t.eval_every, t.progress, t.save_final = 10 ** 6, False, False
    cfg.optim.name, cfg.optim.lr = name, lr
    cfg.optim.muon.scale = "match_rms_adamw"
    return resolve(cfg)


def losses(args, name: str, lr: float, root: str) -> list[float]:
    """The training loss of every step of one run."""
    run_dir = os.path.join(root, f"{name}_{lr:g}")
    os.makedirs(run_dir, exist_ok=True)
    Trainer(config(args, name, lr), ParallelGrid.single(), run_dir).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        curve = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    print(f"{name} lr {lr:g}: final smoothed loss {smooth(curve, args.window)[-1]:.4f}", file=sys.stderr, flush=True)
    return curve


def smooth(curve: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps (fewer at the start)."""
    return [sum(curve[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(curve))]


def first_reaching(curve: list[float], target: float) -> int | None:
    """The first step (1-based) at which `curve` is at or below `target`, None if never."""
    return next((i + 1 for i, v in enumerate(curve) if v <= target), None)


def race(curves: dict[tuple[str, float], list[float]], window: int) -> dict:
    """Best lr per optimizer (lowest final smoothed loss), the target (best AdamW's final smoothed
    loss) and the step at which each best run first reaches it."""
    smoothed = {k: smooth(c, window) for k, c in curves.items()}
    best = {name: min((k for k in smoothed if k[0] == name), key=lambda k: smoothed[k][-1])
            for name in ("adamw", "muon")}
    target = smoothed[best["adamw"]][-1]
    steps = {name: first_reaching(smoothed[k], target) for name, k in best.items()}
    return {"best": best, "target": target, "steps": steps, "smoothed": smoothed}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=384)
    p.add_argument("--task", default="addition")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--muon-lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--every", type=int, default=20)
    args = p.parse_args(argv)
    runs = [("adamw", float(lr)) for lr in args.adamw_lrs.split(",")]
    runs += [("muon", float(lr)) for lr in args.muon_lrs.split(",")]
    with tempfile.TemporaryDirectory() as root:
        curves = {k: losses(args, *k, root) for k in runs}
    out = race(curves, args.window)
    marks = list(range(args.every, args.steps + 1, args.every))
    print(f"# smoothed training loss (trailing mean of {args.window} steps); {args.task}, dim {args.dim}, "
          f"{args.layers} layers, batch {args.batch} x {args.seq_len} tokens")
    print("optimizer  lr      " + " ".join(f"{s:>6d}" for s in marks))
    for (name, lr), curve in out["smoothed"].items():
        print(f"{name:<10} {lr:<7g} " + " ".join(f"{curve[s - 1]:6.3f}" for s in marks))
    la, lm = out["best"]["adamw"][1], out["best"]["muon"][1]
    sa, sm = out["steps"]["adamw"], out["steps"]["muon"]
    print(f"target: best AdamW (lr {la:g}) final smoothed loss {out['target']:.4f}")
    print(f"steps to reach it: AdamW {sa}, Muon (lr {lm:g}) {sm if sm is not None else 'never'}"
          + (f" ({sa / sm:.2f}x fewer)" if sm else ""))


if __name__ == "__main__":
    main()
