"""Parallel degrees as the user sets them (`parallel.*`) and their validation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel degree: ranks that split each linear layer
    pp: int = 1  # pipeline-parallel degree: stages the layers are split into
    dp: Optional[int] = None  # data-parallel degree; None = world_size // (tp * pp)
    vpp: int = 1  # virtual pipeline stages (model chunks) per pp rank; > 1 needs schedule=interleaved
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved
    pp_layers: Optional[List[int]] = None  # layers per virtual stage (pp*vpp entries); None = even split
    sequence_parallel: bool = False  # split norms/dropout regions along the sequence over tp
    backend: str = "auto"  # process-group backend: auto (nccl on GPU, gloo on CPU) | nccl | gloo
    # ZeRO stage over dp: 0 plain dp | 1 Adam state sharded | 2 grads too | 3 params too (pp=1).
    # With dp=1 any stage is a no-op (every shard is the whole model).
    zero: int = 0
    bucket_mb: float = 25.0  # MiB of fp32 grads per dp reduction bucket; smaller = earlier overlap, more launches


def resolve_dp(cfg: ParallelConfig, world_size: int) -> int:
    """dp as set, or derived from the world size when left unset."""
    if cfg.dp is not None:
        return cfg.dp
    return max(world_size // max(cfg.tp * cfg.pp, 1), 1)


def check_parallel(cfg: ParallelConfig, world_size: int) -> list[str]:
    """Every problem with the parallel degrees against `world_size`, each with its fix."""
    errors = []
    for axis in ("tp", "pp", "dp"):
        value = getattr(cfg, axis)
        if value is not None and value < 1:
            errors.append(f"parallel.{axis}={value} must be >= 1; fix: set parallel.{axis} to a positive integer")
    if errors:
        return errors
    dp = resolve_dp(cfg, world_size)
    if cfg.tp * cfg.pp * dp != world_size:
        derived = "" if cfg.dp is not None else " (dp derived as world_size // (tp*pp))"
        errors.append(
            f"world size {world_size} != tp*pp*dp = {cfg.tp}*{cfg.pp}*{dp}{derived}; "
            f"fix: start tp*pp*dp ranks (launcher.nproc or Slurm tasks) or change parallel.tp/pp/dp"
        )
    if cfg.zero not in (0, 1, 2, 3):
        errors.append(f"parallel.zero={cfg.zero} is unknown; fix: 0 (plain dp), 1, 2 or 3")
    elif cfg.zero == 3 and cfg.pp > 1:
        errors.append("parallel.zero=3 with parallel.pp>1 is not supported yet; fix: parallel.zero=2 (or pp=1)")
    if cfg.bucket_mb <= 0:
        errors.append(f"parallel.bucket_mb={cfg.bucket_mb} must be > 0; fix: e.g. parallel.bucket_mb=25")
    if cfg.backend not in ("auto", "nccl", "gloo"):
        errors.append(f"parallel.backend={cfg.backend!r} is unknown; fix: use auto, nccl or gloo")
    return errors
