"""Small configs and rank functions for the end-to-end training tests."""
from __future__ import annotations

import json
import os

from megaft.config import Config, resolve
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer

# (name, tp, dp, sequence_parallel, micro_batch_size) run on 2 ranks in one spawn.
PARALLEL_RUNS = [("tp2", 2, 1, False, 8), ("tp2_sp", 2, 1, True, 8), ("dp2", 1, 2, False, 4)]


def small_config(steps: int = 20, micro: int = 8) -> Config:
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.max_seq_len = 64, 2, 4, 2, 128, 64
    cfg.data.task_train_size, cfg.data.task_eval_size, cfg.data.seq_len = 2000, 32, 32
    t = cfg.train
    t.max_steps, t.micro_batch_size, t.global_batch_size, t.eval_every, t.progress = steps, micro, 16, 10, False
    cfg.optim.warmup_steps = 5
    return resolve(cfg)


def read_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_metrics(run_dir: str) -> tuple[list[float], list[dict]]:
    """(train losses by step, eval records) from run_dir/metrics.jsonl."""
    rows = read_rows(run_dir)
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def train_single(run_dir: str, micro: int = 8) -> None:
    os.makedirs(run_dir, exist_ok=True)
    Trainer(small_config(micro=micro), ParallelGrid.single(), run_dir).fit()


def train_parallel_runs(rank: int, world: int, root: str) -> None:
    for name, tp, dp, sp, micro in PARALLEL_RUNS:
        cfg = small_config(micro=micro)
        cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sequence_parallel = tp, dp, sp
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        grid = ParallelGrid.build(tp=tp, dp=dp, pp=1, device="cpu")
        Trainer(cfg, grid, run_dir).fit()


def train_single_bf16(run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    cfg = small_config(steps=5)
    cfg.precision = "bf16"
    Trainer(cfg, ParallelGrid.single(), run_dir).fit()
