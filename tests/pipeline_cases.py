"""Configs and rank functions for the pipeline-parallel training tests."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from train_cases import small_config

STEPS = 10

# name -> parallel settings; each rank function builds a new grid per config.
# References (pp=1, one process): "ref" and "ref_tied".
PP2_RUNS = {
    "gpipe": dict(pp=2, schedule="gpipe"),
    "1f1b": dict(pp=2, schedule="1f1b"),
    "interleaved": dict(pp=2, vpp=2, schedule="interleaved"),
    "uneven": dict(pp=2, schedule="1f1b", pp_layers=[3, 1]),
    "tied": dict(pp=2, schedule="1f1b", tied=True),
    "tp2_pp1": dict(tp=2),  # grad-norm reference for the tp=2 runs (same tp rounding, no pipeline)
}
RANK4_RUNS = {
    "pp2_tp2": dict(pp=2, tp=2, schedule="1f1b"),
    "pp2_tp2_sp_interleaved": dict(pp=2, tp=2, vpp=2, schedule="interleaved", sequence_parallel=True),
    "pp2_dp2_tied": dict(pp=2, dp=2, schedule="1f1b", tied=True),
    "pp4_1f1b": dict(pp=4, schedule="1f1b"),
    "pp4_gpipe_tied": dict(pp=4, schedule="gpipe", tied=True),
}


def pipeline_config(tied: bool = False, **par) -> Config:
    """The tiny model with 4 layers, 10 steps, 4 micro-batches of 4 per step (dp=1)."""
    cfg = small_config(steps=STEPS, micro=4)
    cfg.model.n_layers, cfg.model.tie_embeddings = 4, tied
    cfg.train.eval_every = 5
    for key, value in par.items():
        setattr(cfg.parallel, key, value)
    return cfg


def train_reference(root: str) -> None:
    for name, tied in (("ref", False), ("ref_tied", True)):
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        Trainer(pipeline_config(tied=tied), ParallelGrid.single(), run_dir).fit()


def _tied_copies_equal(trainer: Trainer) -> bool:
    """Whether the tied embedding's two copies (first and last pp rank) are bit-identical."""
    weight = trainer.model.tied_weight()
    group = trainer.embedding_group
    if weight is None:
        return True
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, weight.detach().contiguous(), group=group)
    return all(torch.equal(copies[0], c) for c in copies[1:])


def train_pipeline_runs(rank: int, world: int, root: str, runs: dict) -> None:
    for name, spec in runs.items():
        spec = dict(spec)
        tied = spec.pop("tied", False)
        cfg = pipeline_config(tied=tied, **spec)
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        dp = world // (tp * pp)
        cfg.parallel.dp = dp
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
        grid = ParallelGrid.build(tp=tp, dp=dp, pp=pp, device="cpu")
        trainer = Trainer(cfg, grid, run_dir)
        trainer.fit()
        if tied:
            ok = torch.tensor([float(_tied_copies_equal(trainer))])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if rank == 0:
                with open(os.path.join(run_dir, "tied.json"), "w") as f:
                    json.dump({"copies_equal": bool(ok.item())}, f)
