"""How far each CPU code path moves a training curve from this machine's default kernels.

    python -m benchmarks.codepaths              # the five code paths below, 20 steps each
    python -m benchmarks.codepaths --steps 40

Trains one small dense model (fp32, single process, the end-to-end tests' config) in a fresh
interpreter per code path (ATEN_CPU_CAPABILITY and MKL_CBWR are read at torch's import) and
prints, against the default's curve measured in the same run, the largest relative deviation
of the loss and the grad norm and the number of steps that differ at all. The code path that
moves the numbers most is the one `make test` runs the exactness tests under
(docs/contributing.md). Deviations depend on the CPU; compare the rows, not the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PATHS = {
    "default": {},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "both (make test's second pass)": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}


def curve(steps: int) -> dict:
    """Train the small config here; {"loss": [...], "grad_norm": [...], "capability": ...}."""
    import torch

    from megaft.config import Config
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer
    from megaft.validation import resolve

    torch.set_num_threads(1)  # one thread: the kernels' own order, no thread split
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.max_seq_len = 64, 2, 4, 2, 128, 64
    cfg.data.task_train_size, cfg.data.task_eval_size, cfg.data.seq_len = 2000, 32, 32
    t = cfg.train
    t.max_steps, t.micro_batch_size, t.global_batch_size, t.eval_every, t.progress = steps, 8, 16, 10, False
    cfg.optim.warmup_steps = 5
    with tempfile.TemporaryDirectory() as run_dir:
        Trainer(resolve(cfg), ParallelGrid.single(), run_dir).fit()
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if "loss" in r]
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
            "capability": torch.backends.cpu.get_cpu_capability()}


def measure(env: dict, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.codepaths", "--one", "--steps", str(steps)],
                         env=dict(os.environ, **env), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def deviation(got: list[float], want: list[float]) -> tuple[float, int]:
    """(largest relative deviation, number of steps that differ)."""
    rel = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    return max(rel), sum(r > 0 for r in rel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--one", action="store_true", help="(internal) train once here and print the curve")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(curve(args.steps)))
        return
    curves = {name: measure(env, args.steps) for name, env in PATHS.items()}
    base = curves["default"]
    print(f"{args.steps} steps, fp32, single process; deviation from the default code path "
          f"({base['capability']}) measured in this run")
    print(f"{'code path':34s} {'ATen':8s} {'loss max rel':>13s} {'steps':>6s} {'grad_norm max rel':>18s} {'steps':>6s}")
    for name, c in curves.items():
        (lm, ln), (gm, gn) = deviation(c["loss"], base["loss"]), deviation(c["grad_norm"], base["grad_norm"])
        print(f"{name:34s} {c['capability']:8s} {lm:13.2e} {ln:6d} {gm:18.2e} {gn:6d}")


if __name__ == "__main__":
    main()
