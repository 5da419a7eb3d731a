"""The optimizer step of AdamW and Muon (optim.name), at tp 1 and 2 and at dp 2 with ZeRO 1 and
3, on CPU gloo ranks, as ratios measured in the same run (issue 41).

    python -m benchmarks.optim [--dim D] [--ffn F] [--heads H] [--kv-heads K] [--layers L]
                               [--vocab V] [--steps N] [--layouts tp1,tp2,dp2_zero1,dp2_zero3]

Each variant is megaft's Trainer on a model of the given block shape (default 1024 wide, MLP 4096,
16 heads over 4 kv heads: a 1B model's proportions at half its width, since Newton-Schulz on a
2048 x 8192 matrix takes seconds on a CPU; vocabulary 4096, one 16-token row a step). The time is
the metrics line's `optimizer_s` (train.log_phases: the clip and the step, the grad-norm
all-reduce, Muon's gathers and Newton-Schulz), the median of --steps steps after the first. Muon's
matrices run Newton-Schulz in bf16, where a CPU has little of a GPU's advantage: the CPU ratios
say where the time goes, not what a GPU will show (`make gpu-check` when one is at hand).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from benchmarks.ranks import on_gloo_ranks
from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import resolve

LAYOUTS = {"tp1": dict(), "tp2": dict(tp=2), "dp2_zero1": dict(dp=2, zero=1), "dp2_zero3": dict(dp=2, zero=3)}


def config(args, name: str, layout: dict) -> Config:
    cfg = Config()
    m = cfg.model
    m.dim, m.ffn_dim, m.n_heads, m.n_kv_heads, m.n_layers = args.dim, args.ffn, args.heads, args.kv_heads, args.layers
    m.vocab_size, m.max_seq_len = args.vocab, 32
    cfg.data.task_train_size, cfg.data.task_eval_size, cfg.data.seq_len = 200, 8, 16
    t = cfg.train
    t.max_steps, t.micro_batch_size, t.global_batch_size = args.steps + 1, 1, layout.get("dp", 1)
    t.eval_every, t.progress, t.log_phases, t.save_final = 10 ** 6, False, True, False
    cfg.optim.name, cfg.optim.warmup_steps = name, 0
    for k, v in layout.items():
        setattr(cfg.parallel, k, v)
    return resolve(cfg)


def optimizer_seconds(rank: int, world: int, args, name: str, layout: dict, root: str) -> float:
    par = dict(tp=layout.get("tp", 1), dp=layout.get("dp", 1), pp=1, device="cpu")
    grid = ParallelGrid.single() if world == 1 else ParallelGrid.build(**par)
    run_dir = os.path.join(root, f"{name}_{'_'.join(f'{k}{v}' for k, v in layout.items()) or 'tp1'}")
    os.makedirs(run_dir, exist_ok=True)
    Trainer(config(args, name, layout), grid, run_dir).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        times = [r["optimizer_s"] for r in map(json.loads, f) if "optimizer_s" in r]
    return statistics.median(times[1:])  # the first step allocates the state


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one untimed)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args(argv)
    print(f"optimizer step (median optimizer_s), dim {args.dim}, MLP {args.ffn}, {args.heads}/{args.kv_heads} "
          f"heads, {args.layers} layer(s), vocabulary {args.vocab}, fp32, CPU gloo ranks")
    print(f"{'layout':>10} {'adamw ms':>10} {'muon ms':>10} {'muon/adamw':>11}")
    with tempfile.TemporaryDirectory() as root:
        for key in args.layouts.split(","):
            layout = LAYOUTS[key]
            world = layout.get("tp", 1) * layout.get("dp", 1)
            got = {name: (optimizer_seconds(0, 1, args, name, layout, root) if world == 1 else
                          on_gloo_ranks(world, optimizer_seconds, args, name, layout, root))
                   for name in ("adamw", "muon")}
            print(f"{key:>10} {got['adamw'] * 1e3:10.1f} {got['muon'] * 1e3:10.1f} {got['muon'] / got['adamw']:11.2f}")


if __name__ == "__main__":
    main()
