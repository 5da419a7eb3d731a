"""Configs and rank functions for the context-parallel tests (issue 13, part 2).

One spawn per world size trains every layout of that size; each run records its loss
curve (metrics.jsonl), its first-step gradients by name (`grads_<rank>.pt`, see
pipeline_cases.fit_capturing) and, for runs with `save`, checkpoints at steps 5
and 10. The same spawn measures the bytes one block saves for backward at each
tp/sp/cp/recompute choice and the ring's traffic (`saved_bytes_<world>.json`, written by
benchmarks.memory.measure_layouts), and ring attention against SDPA (`ring_errors_<world>.json`).
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from pipeline_cases import fit_capturing
from train_cases import small_config

from benchmarks.memory import measure_layouts
from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer

STEPS = 10

# name -> settings; "recompute" sets model.recompute, "docs" trains on document-packed rows,
# "resume_from" starts from that single-process run's step-5 checkpoint.
CP2_RUNS = {
    "cp2": dict(cp=2, save=True),
    "cp2_selective": dict(cp=2, recompute="selective"),
    "cp2_full": dict(cp=2, recompute="full"),
    "cp2_docs": dict(cp=2, docs=True),
    "cp2_docs_selective": dict(cp=2, docs=True, recompute="selective"),
    "cp2_from_ref": dict(cp=2, resume_from="ref"),
    "tp2_sp": dict(tp=2, sequence_parallel=True),  # cp2_tp2_sp's gradients without cp (same tp rounding)
}
RANK4_RUNS = {
    "cp2_tp2_sp": dict(cp=2, tp=2, sequence_parallel=True, save=True),
    "cp2_tp2_sp_full": dict(cp=2, tp=2, sequence_parallel=True, recompute="full"),
    "cp2_pp2": dict(cp=2, pp=2, schedule="1f1b"),
    "cp2_pp2_selective": dict(cp=2, pp=2, schedule="1f1b", recompute="selective"),
    "cp2_pp2_interleaved": dict(cp=2, pp=2, vpp=2, schedule="interleaved"),  # one layer per virtual stage
    "cp2_dp2_zero1": dict(cp=2, dp=2, zero=1),
    "cp2_dp2_zero2": dict(cp=2, dp=2, zero=2),
    "cp2_dp2_zero3": dict(cp=2, dp=2, zero=3),
    "cp2_dp2_zero3_full": dict(cp=2, dp=2, zero=3, recompute="full"),
    "cp4": dict(cp=4),
    "cp4_selective": dict(cp=4, recompute="selective"),
}
REFERENCES = {"ref": dict(save=True), "ref_docs": dict(docs=True)}
SETTINGS = ("docs", "recompute", "save", "resume_from")


def reference_of(spec: dict) -> str:
    return "ref_docs" if spec.get("docs") else "ref"


def cp_config(docs: bool = False, recompute: str = "none", save: bool = False, **par) -> Config:
    """The tiny model, 10 steps of 2 micro-batches of 8 rows of 32 tokens (4 layers, so pp=2
    has two per stage); packed documents kept apart with `docs`."""
    cfg = small_config(steps=STEPS, micro=8)
    cfg.model.n_layers, cfg.model.recompute = 4, recompute
    cfg.data.packing = "docs" if docs else "stream"
    cfg.train.save_every = 5 if save else 0
    for name, value in par.items():
        setattr(cfg.parallel, name, value)
    return cfg


def _resume_copy(src: str, dst: str) -> None:
    """`src`'s run directory as it was right after its step-5 checkpoint."""
    shutil.copytree(src, dst)
    shutil.rmtree(os.path.join(dst, "checkpoints", "step_000010"))
    os.remove(os.path.join(dst, "summary.json"))


def run(name: str, spec: dict, root: str, grid: ParallelGrid) -> Trainer:
    run_dir = os.path.join(root, name)
    if spec.get("resume_from"):
        if grid.rank == 0:
            _resume_copy(os.path.join(root, spec["resume_from"]), run_dir)
        if grid.world_size > 1:
            dist.barrier()
    os.makedirs(run_dir, exist_ok=True)
    cfg = cp_config(**{k: v for k, v in spec.items() if k in SETTINGS and k != "resume_from"},
                    **{k: v for k, v in spec.items() if k not in SETTINGS})
    return fit_capturing(cfg, grid, run_dir)


def train_references(root: str) -> None:
    for name, spec in REFERENCES.items():
        run(name, spec, root, ParallelGrid.single())


def train_cp_runs(rank: int, world: int, root: str, runs: dict, measure: bool = False) -> None:
    for name, spec in runs.items():
        tp, pp, cp = spec.get("tp", 1), spec.get("pp", 1), spec.get("cp", 1)
        grid = ParallelGrid.build(tp=tp, dp=world // (tp * pp * cp), pp=pp, cp=cp, device="cpu")
        run(name, spec, root, grid)
    if measure:
        saved = measure_layouts(rank, world)  # saved bytes per block and ring traffic (benchmarks.memory)
        if rank == 0:
            with open(os.path.join(root, f"saved_bytes_{world}.json"), "w") as f:
                json.dump(saved, f)
        check_ring(rank, world, root)


# -- ring attention against SDPA -----------------------------------------------------------

RING_CASES = {  # name -> (window, packed documents, dtype)
    "causal": (None, False, torch.float32),  # plain blocks: the flash kernel
    "window": (5, False, torch.float32),  # masked blocks: the explicit form
    "docs": (None, True, torch.float32),
    "docs_window": (5, True, torch.float32),
    "causal_bf16": (None, False, torch.bfloat16),
}


def check_ring(rank: int, world: int, root: str) -> None:
    """ring_errors_<world>.json: per case, the largest |ring - SDPA on the whole rows| of the
    output and of dq, dk, dv (GQA: 4 query heads over 2 kv heads), over every rank."""
    import torch.nn.functional as F

    from megaft.parallel.context.layout import ContextShard
    from megaft.parallel.context.ring import ring_attention

    group = dist.group.WORLD
    b, h, kvh, seq, d = 2, 4, 2, 8 * world, 8
    out = {}
    for name, (window, docs, dtype) in RING_CASES.items():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, n, seq, d, generator=g) for n in (h, kvh, kvh))
        grad = torch.randn(b, h, seq, d, generator=g)
        doc = torch.tensor([[0] * 5 + [1] * (seq - 12) + [2] * 7, [0] * seq]) if docs else None
        i = torch.arange(seq)
        allowed = (i[None] <= i[:, None]) & ((i[None] > i[:, None] - window) if window else True)
        allowed = allowed[None, None] if doc is None else allowed & (doc[:, None, :, None] == doc[:, None, None, :])
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in, attn_mask=allowed, enable_gqa=True)
        ref.backward(grad)
        shard = ContextShard(group, seq, doc)
        idx = shard.index()
        mine = [t[:, :, idx].to(dtype).requires_grad_() for t in (q, k, v)]
        got = ring_attention(*mine, shard, window)
        got.float().backward(grad[:, :, idx])
        errs = [(a.float() - r_[:, :, idx]).abs().max().item()
                for a, r_ in zip([got, *(t.grad for t in mine)], [ref, *(t.grad for t in ref_in)])]
        worst = torch.tensor(errs)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[name] = worst.tolist()
    if rank == 0:
        with open(os.path.join(root, f"ring_errors_{world}.json"), "w") as f:
            json.dump(out, f)

