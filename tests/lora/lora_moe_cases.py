"""Configs and the rank function of the LoRA-on-experts tests (tests/lora/test_lora_moe.py),
in a module the spawned ranks import without peft or transformers."""
from __future__ import annotations

import os

from megaft.config import Config
from megaft.config.lora import LoraConfig
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import validate

# Qwen2-MoE has all three kinds: routed experts, a shared expert, a dense layer (mlp_only_layers)
TARGETS = ["q", "v", "gate", "up", "down", "experts", "shared_expert", "router"]
# name -> parallel settings, every one on 2 ranks in one spawn: experts split over ep (with ZeRO-1 over
# the dense replicas), and every expert split over tp with sequence parallel (the router adapter's sum)
LAYOUTS = {"ep2": dict(dp=2, ep=2, zero=1), "tp2": dict(tp=2, sequence_parallel=True)}
STEPS = 3


def lora_moe_config(ckpt: str, data: str, *, export_merged: bool = False, **parallel) -> Config:
    """3 steps of 8 sequences (micro-batches of 4), a checkpoint each step (verify reads step 1's
    first moments as the gradients; the ep=1 resume starts from it), the peft export at the end."""
    cfg = Config()
    cfg.model.init_from, cfg.device = ckpt, "cpu"
    cfg.data.path, cfg.data.seq_len = data, 16
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.max_steps = 4, 8, STEPS
    t.save_every, t.keep_last, t.eval_every, t.export_hf = 1, 0, STEPS, True
    t.progress, t.tensorboard, t.log_phases = False, "false", False
    cfg.optim.lr = 1e-2
    cfg.lora = LoraConfig(rank=4, alpha=8.0, targets=list(TARGETS), export_merged=export_merged)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    cfg.launcher.nproc = cfg.parallel.tp * (cfg.parallel.dp or 1)
    problems = validate(cfg, cfg.launcher.nproc)  # resolves cfg from the checkpoint too
    assert problems == [], problems
    return cfg


def layouts_rank(rank: int, world: int, ckpt: str, data: str, root: str) -> None:
    for name, par in LAYOUTS.items():
        cfg = lora_moe_config(ckpt, data, **par)
        grid = ParallelGrid.build(tp=par.get("tp", 1), dp=par.get("dp", 1), pp=1, ep=par.get("ep", 1), device="cpu")
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        Trainer(cfg, grid, run_dir).fit()
