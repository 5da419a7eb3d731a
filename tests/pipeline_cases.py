"""Configs and rank functions for the pipeline-parallel training tests.

Besides the loss curves (metrics.jsonl), every run records, in one spawn:
* `grads_<rank>.pt`: this rank's gradients at the first optimizer step, by full
  parameter name and at full (tp-gathered, unpadded) shape, written by the
  tp_rank 0 / dp_rank 0 rank of each pp stage (see `capture_first_grads`);
* with `export` in its spec, `RUN_DIR/hf` (train.export_hf) and `generated.json`: greedy
  completions of a few fixed prompts, generated through the pipeline.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from train_cases import small_config

from megaft.config import Config
from megaft.parallel.comm import all_gather
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.shard import shard_of
from megaft.training.loop import Trainer

STEPS = 10
PROMPTS = [[3, 5, 7, 9], [4, 4, 4, 4], [11, 2, 6]]  # token ids; same on every rank
NEW_TOKENS = 6

# name -> parallel settings; each rank function builds a new grid per config.
# References (pp=1, one process): "ref", "ref_tied" and "ref_l8" (8 layers, for pp*vpp = 8).
PP2_RUNS = {
    "gpipe": dict(pp=2, schedule="gpipe"),
    "1f1b": dict(pp=2, schedule="1f1b", export=True),
    "interleaved": dict(pp=2, vpp=2, schedule="interleaved"),
    "uneven": dict(pp=2, schedule="1f1b", pp_layers=[3, 1]),
    "tied": dict(pp=2, schedule="1f1b", tied=True, export=True),
    "tp2_pp1": dict(tp=2, export=True),  # reference for the tp=2 runs (same tp rounding, no pipeline)
    "tp2_sp_ring_pp1": dict(tp=2, sequence_parallel=True, tp_overlap="ring"),  # ... for the ring's (its rounding)
}
RANK4_RUNS = {
    "pp2_tp2": dict(pp=2, tp=2, schedule="1f1b", export=True),
    "pp2_tp2_sp_interleaved": dict(pp=2, tp=2, vpp=2, schedule="interleaved", sequence_parallel=True),
    # parallel.tp_overlap=ring inside the pipeline stages (megaft.parallel.tensor.overlap)
    "pp2_tp2_sp_ring": dict(pp=2, tp=2, schedule="1f1b", sequence_parallel=True, tp_overlap="ring"),
    "pp2_dp2_tied": dict(pp=2, dp=2, schedule="1f1b", tied=True),
    "pp4_1f1b": dict(pp=4, schedule="1f1b"),
    "pp4_gpipe_tied": dict(pp=4, schedule="gpipe", tied=True),
    "pp4_interleaved": dict(pp=4, vpp=2, schedule="interleaved", layers=8, export=True),
}
REFERENCES = {"ref": dict(export=True), "ref_tied": dict(tied=True, export=True), "ref_l8": dict(layers=8, export=True)}


def reference_of(spec: dict) -> str:
    """The pp=1 single-process run with the same model as `spec`."""
    if spec.get("tied"):
        return "ref_tied"
    return "ref_l8" if spec.get("layers") == 8 else "ref"


def pipeline_config(tied: bool = False, layers: int = 4, export: bool = False, **par) -> Config:
    """The tiny model with `layers` layers, 10 steps, 4 micro-batches of 4 per step (dp=1)."""
    cfg = small_config(steps=STEPS, micro=4)
    cfg.model.n_layers, cfg.model.tie_embeddings = layers, tied
    cfg.train.eval_every, cfg.train.export_hf = 5, export
    for key, value in par.items():
        setattr(cfg.parallel, key, value)
    return cfg


def capture_first_grads(trainer: Trainer, path: str) -> None:
    """Wrap the optimizer so its first step saves the gradients it is about to apply
    (after pp/tied/dp reductions and clipping) by name, at full shape, to `path`."""
    grid, step = trainer.grid, trainer.parts.optim.optimizer.step
    writer = grid.tp_rank == 0 and grid.dp_rank == 0

    def first_step(*args, **kwargs):
        grads = {}
        for name, p in trainer.parts.model.named_parameters():
            g = p.grad.detach()
            spec = shard_of(p)
            if spec is not None:  # collective over tp: every tp rank gathers
                g = all_gather(g.contiguous(), spec.dim, grid.tp_group).narrow(spec.dim, 0, spec.full)
            grads[name] = g.cpu().clone()
        if writer:
            torch.save(grads, path)
        trainer.parts.optim.optimizer.step = step  # only the first step
        return step(*args, **kwargs)

    trainer.parts.optim.optimizer.step = first_step


def _run(name: str, spec: dict, root: str, grid: ParallelGrid) -> Trainer:
    run_dir = os.path.join(root, name)
    os.makedirs(run_dir, exist_ok=True)
    return fit_capturing(pipeline_config(**spec), grid, run_dir)


def fit_capturing(cfg: Config, grid: ParallelGrid, run_dir: str) -> Trainer:
    """Train `cfg` on `grid` into run_dir, saving the first step's gradients (below ZeRO-2:
    ZeRO-2/3 keep only their shard of them) as grads_<rank>.pt."""
    cfg.parallel.dp = grid.dp_size
    trainer = Trainer(cfg, grid, run_dir)
    if cfg.parallel.zero < 2:
        capture_first_grads(trainer, os.path.join(run_dir, f"grads_{grid.rank}.pt"))
    trainer.fit()
    return trainer


def train_reference(root: str) -> None:
    for name, spec in REFERENCES.items():
        _run(name, spec, root, ParallelGrid.single())


def _tied_copies_equal(trainer: Trainer) -> bool:
    """Whether the tied embedding's two copies (first and last pp rank) are bit-identical."""
    weight = trainer.parts.model.tied_weight()
    group = trainer.grid.embedding_group
    if weight is None:
        return True
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, weight.detach().contiguous(), group=group)
    return all(torch.equal(copies[0], c) for c in copies[1:])


def _generate(trainer: Trainer, run_dir: str) -> None:
    """Greedy completions of PROMPTS through the pipeline, written by rank 0."""
    from megaft.inference.generate import pipeline_greedy_generate

    outs = pipeline_greedy_generate(trainer.parts.step.runtime, PROMPTS, max_new_tokens=NEW_TOKENS, eos_id=None)
    if trainer.grid.rank == 0:
        with open(os.path.join(run_dir, "generated.json"), "w") as f:
            json.dump(outs, f)


def train_pipeline_runs(rank: int, world: int, root: str, runs: dict) -> None:
    for name, spec in runs.items():
        tp, pp = spec.get("tp", 1), spec.get("pp", 1)
        grid = ParallelGrid.build(tp=tp, dp=world // (tp * pp), pp=pp, device="cpu")
        trainer = _run(name, spec, root, grid)
        run_dir = os.path.join(root, name)
        if spec.get("export") and pp > 1:
            _generate(trainer, run_dir)
        if spec.get("tied"):
            ok = torch.tensor([float(_tied_copies_equal(trainer))])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if rank == 0:
                with open(os.path.join(run_dir, "tied.json"), "w") as f:
                    json.dump({"copies_equal": bool(ok.item())}, f)
