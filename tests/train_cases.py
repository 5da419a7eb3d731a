"""Small configs and rank functions for the end-to-end training tests."""
from __future__ import annotations

import json
import os

from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import resolve

# (name, tp, dp, sequence_parallel, micro_batch_size) run on 2 ranks in one spawn; "_ring": with
# parallel.tp_overlap=ring and model.recompute=full (the rings run again inside the recomputed blocks).
PARALLEL_RUNS = [("tp2", 2, 1, False, 8), ("tp2_sp", 2, 1, True, 8), ("dp2", 1, 2, False, 4),
                 ("tp2_sp_ring", 2, 1, True, 8)]


def small_config(steps: int = 20, micro: int = 8) -> Config:
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.max_seq_len = 64, 2, 4, 2, 128, 64
    cfg.data.task_train_size, cfg.data.task_eval_size, cfg.data.seq_len = 2000, 32, 32
    t = cfg.train
    t.max_steps, t.micro_batch_size, t.global_batch_size, t.eval_every, t.progress = steps, micro, 16, 10, False
    cfg.optim.warmup_steps = 5
    return resolve(cfg)


def layout_grid(par: dict) -> ParallelGrid:
    """This rank's grid of a layout's parallel settings (tp, dp, pp, cp, ep; 1 where unset), on CPU."""
    return ParallelGrid.build(tp=par.get("tp", 1), dp=par.get("dp", 1), pp=par.get("pp", 1), cp=par.get("cp", 1),
                              ep=par.get("ep", 1), device="cpu")


def run(cfg: Config, grid: ParallelGrid, run_dir: str) -> None:
    """Train `cfg` to its end in `run_dir` (made if missing)."""
    os.makedirs(run_dir, exist_ok=True)
    Trainer(cfg, grid, run_dir).fit()


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
        if name.endswith("_ring"):
            cfg.parallel.tp_overlap, cfg.model.recompute = "ring", "full"
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        grid = ParallelGrid.build(tp=tp, dp=dp, pp=1, device="cpu")
        trainer = Trainer(cfg, grid, run_dir)
        for block in trainer.parts.model.layers:  # parallel.tp_overlap reached the layers (or stayed off)
            assert block.self_attn.q_proj.ring == block.mlp.down_proj.ring == name.endswith("_ring"), name
        trainer.fit()


def train_single_bf16(run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    cfg = small_config(steps=5)
    cfg.precision = "bf16"
    Trainer(cfg, ParallelGrid.single(), run_dir).fit()


# Data parallel / ZeRO (issue 4): name -> parallel settings, 10 steps, global batch 16.
# micro=4 gives dp=2 ranks two micro-batches each (accumulation); bucket_mb=0.01 cuts the
# tiny model into many buckets, so the hooks really launch several collectives.
DP_STEPS = 10
DP2_RUNS = {
    "dp2_zero0": dict(dp=2, zero=0, bucket_mb=0.01),
    "dp2_zero1": dict(dp=2, zero=1, bucket_mb=0.01),
    "dp2_zero2": dict(dp=2, zero=2, bucket_mb=0.01),
    "dp2_zero1_one_bucket": dict(dp=2, zero=1),
    "dp2_zero3": dict(dp=2, zero=3),
    "dp2_zero3_tied": dict(dp=2, zero=3, tied=True),
}
DP4_RUNS = {
    "dp2_tp2_zero0": dict(dp=2, tp=2, zero=0, bucket_mb=0.01),
    "dp2_tp2_sp_zero2": dict(dp=2, tp=2, zero=2, bucket_mb=0.01, sequence_parallel=True),
    "dp2_pp2_zero0": dict(dp=2, pp=2, zero=0, bucket_mb=0.01),
    "dp2_pp2_tied_zero1": dict(dp=2, pp=2, zero=1, bucket_mb=0.01, tied=True),
    "dp2_tp2_sp_zero3": dict(dp=2, tp=2, zero=3, sequence_parallel=True),
}


def dp_config(tied: bool = False, **par) -> Config:
    """small_config for 10 steps, 4 layers (so pp=2 has 2 per stage), micro-batches of 4."""
    cfg = small_config(steps=DP_STEPS, micro=4)
    cfg.model.n_layers, cfg.model.tie_embeddings = 4, tied
    cfg.train.eval_every = 5
    for key, value in par.items():
        setattr(cfg.parallel, key, value)
    return cfg


def train_dp_reference(root: str) -> None:
    for name, tied in (("ref", False), ("ref_tied", True)):
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        Trainer(dp_config(tied=tied), ParallelGrid.single(), run_dir).fit()


def train_dp_runs(rank: int, world: int, root: str, runs: dict) -> None:
    """Every config of `runs` on this world, one after another (one spawn)."""
    for name, spec in runs.items():
        spec = dict(spec)
        cfg = dp_config(tied=spec.pop("tied", False), **spec)
        par = cfg.parallel
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        grid = ParallelGrid.build(tp=par.tp, dp=par.dp, pp=par.pp, device="cpu")
        Trainer(cfg, grid, run_dir).fit()


FP16_INF_STEP = 2  # 0-based step whose backward gets an inf gradient on dp rank 1 only


def _inject_inf(trainer: Trainer, at_step: int) -> None:
    """Make dp rank 1's gradient of one weight inf during step `at_step` (no other rank sees it
    locally: the skip must come from the all-rank agreement)."""
    step_fn = trainer.train_step

    def train_step(step: int):
        handle = None
        if step == at_step and trainer.grid.dp_rank == 1:
            handle = trainer.parts.optim.flat.params[0].register_hook(lambda g: g * float("inf"))
        try:
            return step_fn(step)
        finally:
            if handle is not None:
                handle.remove()

    trainer.train_step = train_step


def train_fp16_and_resume(rank: int, world: int, root: str) -> None:
    """fp16 at dp=2, zero=1 with an inf injected at FP16_INF_STEP: straight, and stopped after
    5 steps then resumed (the scaler state must come back from the checkpoint). Also zero=2 and
    zero=3 runs stopped and resumed, to compare with the straight dp2_zero2/dp2_zero3 runs."""
    grid = ParallelGrid.build(tp=1, dp=2, pp=1, device="cpu")
    for name, stop in (("fp16", None), ("fp16_resumed", 5), ("fp16_resumed", None)):
        cfg = dp_config(dp=2, zero=1, bucket_mb=0.01)
        cfg.precision, cfg.train.save_every = "fp16", 5 if name.endswith("resumed") else 0
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        trainer = Trainer(cfg, grid, run_dir)
        _inject_inf(trainer, FP16_INF_STEP)
        trainer.fit(stop_after=stop)
        if rank == 0:
            with open(os.path.join(run_dir, "optimizer.json"), "w") as f:
                json.dump({"step_count": trainer.parts.optim.optimizer.step_count}, f)
    for name in ("dp2_zero2", "dp2_zero3"):
        for stop in (5, None):
            cfg = dp_config(**DP2_RUNS[name])
            cfg.train.save_every = 5
            run_dir = os.path.join(root, f"{name}_resumed")
            os.makedirs(run_dir, exist_ok=True)
            Trainer(cfg, grid, run_dir).fit(stop_after=stop)
