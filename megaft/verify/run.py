"""Running the two sides of `megaft-verify`: the user's layout and the single-process reference.

Both runs take `verify.steps` steps from the same seed and data, in
`verify.precision`, each in its own directory under the verify run directory, and
save a checkpoint at step 1 (the gradient comparison reads it). The reference is
one process with tp = pp = dp = 1, no ZeRO, offload or compression, and the torch
reference kernels. The layout runs as megaft-train would run it: local ranks, or
this process's rank under torchrun/srun (rank 0 then runs the reference too).
"""
from __future__ import annotations

import copy
import functools
import os
import shutil
from typing import Optional

from megaft.checkpoint.io import step_dir
from megaft.checkpoint.reshard import named_tensors
from megaft.config import Config, ConfigError
from megaft.config.kernels import KernelsConfig
from megaft.config.parallel import ParallelConfig, resolve_dp
from megaft.config.verify import Shrink, check_verify
from megaft.fileio import write_json_atomic
from megaft.models.vision.checks import trains_images
from megaft.parallel.grid import ParallelGrid
from megaft.training.parts import TrainSpec
from megaft.validation import check_local_launch, validate
from megaft.verify.compare import Report, compare
from megaft.verify.shrink import shrink


def _for_verify(cfg: Config, steps: int) -> Config:
    """`cfg` as a short verification run: `steps` steps, a checkpoint at step 1, fresh start."""
    out = copy.deepcopy(cfg)
    t = out.train
    t.max_steps, t.save_every, t.keep_last, t.resume, t.async_save = steps, 1, 0, False, False
    t.epochs = None  # a run sized in epochs is verified for `steps` steps too
    t.export_hf, t.progress, t.tensorboard, t.eval_every = False, False, "false", steps
    out.precision = cfg.verify.precision
    return out


def reference_of(cfg: Config) -> Config:
    """The single-process, torch-kernel twin of a (resolved) layout config."""
    ref = copy.deepcopy(cfg)
    ref.parallel = ParallelConfig(tp=1, pp=1, dp=1)
    ref.kernels = KernelsConfig(backend="torch", autotune=False)
    ref.optim.fused = "torch"
    ref.launcher.nproc = 1
    return ref


def dropout_off(cfg: Config, world_size: int) -> Optional[str]:
    """Turn model.dropout and lora.dropout off in `cfg` when its layout cannot draw the single
    process's masks, and say so; None when it can (tp, sequence parallel) or there is none.
    Each dp×cp replica and pipeline stage draws from its own stream (megaft.training.loop's
    dropout_seed), so with dropout such a layout equals the single process only in distribution."""
    par = cfg.parallel
    split = {k: v for k, v in (("dp", resolve_dp(par, world_size)), ("cp", par.cp), ("pp", par.pp)) if v > 1}
    on = {k: v for k, v in (("model.dropout", cfg.model.dropout), ("lora.dropout", cfg.lora.dropout)) if v}
    if not (split and on):
        return None
    cfg.model.dropout = cfg.lora.dropout = 0.0
    return (f"{', '.join(f'{k}={v}' for k, v in on.items())} set to 0 on both sides: at "
            f"{', '.join(f'{k}={v}' for k, v in split.items())} each replica and pipeline stage draws its own "
            "dropout masks, so the layout equals the single process only with dropout off (tp and sequence "
            "parallel draw the same masks and keep it on)")


def plan(cfg: Config, world_size: int, *, local: bool) -> tuple[Config, Config, list[str]]:
    """(layout config, reference config, notes for the report), validated; raises ConfigError
    with every problem."""
    problems = check_verify(cfg.verify) + validate(cfg, world_size) + (check_local_launch(cfg) if local else [])
    if cfg.verify.shrink == Shrink.auto and trains_images(cfg):  # shrink drops the checkpoint, its tower with it
        problems.append("verify.shrink=auto with images: the shrunk model is a random text model, with no vision "
                        "tower to verify; fix: verify.shrink=none (the checkpoint itself, docs/vision.md)")
    if problems:
        raise ConfigError(problems)
    user = shrink(cfg) if cfg.verify.shrink == Shrink.auto else cfg
    user = _for_verify(user, cfg.verify.steps)
    notes = [n for n in [dropout_off(user, world_size)] if n]
    ref = reference_of(user)
    problems = [f"layout: {p}" for p in validate(user, world_size)] + [f"reference: {p}" for p in validate(ref, 1)]
    if problems:
        raise ConfigError(problems)
    return user, ref, notes


def step1_grads(run_dir: str, beta1: float) -> Optional[dict]:
    """Every parameter's clipped step-1 gradient: AdamW's first moment after one step / (1 - beta1)."""
    ckpt = step_dir(os.path.join(run_dir, "checkpoints"), 1)
    if not os.path.isdir(ckpt):
        return None
    return {name: m / (1 - beta1) for name, m in named_tensors(ckpt, "exp_avg").items()}


def run_reference(ref: Config, run_dir: str) -> None:
    from megaft.training.loop import Trainer

    Trainer(ref, ParallelGrid.single(), run_dir).fit()


def run_verify(cfg: Config, run_dir: str, *, spec: TrainSpec = TrainSpec(), env=None,
               threads: int = 0) -> Optional[Report]:
    """Verify `cfg` in `run_dir` (layout/ and reference/ below it); the report on the rank
    that compares (this process locally, rank 0 under torchrun/srun), None elsewhere.
    `spec` composes the layout's run (tests inject faults through it)."""
    world = env.world_size if env else cfg.launcher.nproc
    user, ref, notes = plan(cfg, world, local=env is None)
    user_dir, ref_dir = os.path.join(run_dir, "layout"), os.path.join(run_dir, "reference")
    # A verification always starts fresh, and only rank 0 clears: the other ranks of srun/torchrun
    # touch nothing here before the process group's rendezvous, which rank 0 reaches only after
    # clearing (a peer's makedirs between rank 0's rmtree and makedirs failed a CI run).
    if env is None or env.rank == 0:
        for d in (user_dir, ref_dir):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
    if env is None:
        from megaft.launch.local import launch_local
        from megaft.launch.rank import local_worker

        launch_local(user, user_dir, worker=functools.partial(local_worker, spec=spec))
    else:
        from megaft.launch.rank import run_rank

        run_rank(user, user_dir, env, threads, spec=spec)
        if env.rank != 0:
            return None
    run_reference(ref, ref_dir)
    beta1 = user.optim.beta1
    report = compare(os.path.join(user_dir, "metrics.jsonl"), os.path.join(ref_dir, "metrics.jsonl"),
                     step1_grads(user_dir, beta1), step1_grads(ref_dir, beta1), user.verify.tolerances())
    report.notes = notes
    return report


class VerifyFailed(RuntimeError):
    """A Slurm verification whose layout differs from the single process (the job fails)."""


def write_report(report: Report, run_dir: str) -> str:
    """Print the report and write verify.json in `run_dir`; returns its path."""
    path = os.path.join(run_dir, "verify.json")
    print(report.format(), flush=True)
    write_json_atomic(path, report.to_json())
    return path


def slurm_body(cfg: Config, run_dir: str, env, threads: int) -> dict:
    """The Slurm task of `megaft-verify -m hydra/launcher=slurm...` (megaft.launch.submit_task):
    every task runs its rank of the layout, rank 0 the reference and the report; a layout
    that differs fails the job, so Slurm and megaft-report show it."""
    os.makedirs(run_dir, exist_ok=True)
    report = run_verify(cfg, run_dir, env=env, threads=threads)
    if report is None:
        return {}
    write_report(report, run_dir)
    if not report.passed:
        raise VerifyFailed("; ".join(report.failures))
    return report.to_json()
