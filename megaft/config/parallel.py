"""Parallel degrees as the user sets them (`parallel.*`) and their validation."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import List, Optional


# Choices as enums: Hydra rejects other values when composing, naming the allowed ones.
# Member names equal their values, so a member hashes and compares like its string.
class Offload(StrEnum):
    none = "none"
    cpu = "cpu"


class Compression(StrEnum):
    none = "none"
    bf16 = "bf16"
    powersgd = "powersgd"


class Backend(StrEnum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class TPOverlap(StrEnum):
    none = "none"
    ring = "ring"


# megaft.pipeline.schedules builds them ("1f1b" is not an identifier: the functional form)
Schedule = StrEnum("Schedule", [(name, name) for name in ("gpipe", "1f1b", "interleaved")])


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel degree: ranks that split each linear layer
    pp: int = 1  # pipeline-parallel degree: stages the layers are split into
    dp: Optional[int] = None  # data-parallel degree; None = world_size // (tp * cp * pp)
    # context-parallel degree: ranks that split every sequence (load-balanced ring attention,
    # megaft.parallel.context); parameters are replicated over cp like over dp
    cp: int = 1
    # expert-parallel degree (mixtures of experts): ranks, taken from the dp×cp replicas, that split
    # the routed experts, tokens sent to their experts' rank by all-to-all (megaft.parallel.expert);
    # must divide dp*cp and model.n_experts. Dense layers stay replicated over those ranks.
    ep: int = 1
    vpp: int = 1  # virtual pipeline stages (model chunks) per pp rank; > 1 needs schedule=interleaved
    schedule: Schedule = Schedule["1f1b"]  # pipeline schedule: gpipe | 1f1b | interleaved
    pp_layers: Optional[List[int]] = None  # layers per virtual stage (pp*vpp entries); None = even split
    sequence_parallel: bool = False  # split norms/dropout regions along the sequence over tp
    # none | ring: with sequence_parallel at tp > 1, the all-gather before the column-parallel linears and
    # the reduce-scatter after the row-parallel ones (and their backward pairs) run as tp p2p ring steps,
    # each chunk's GEMM beside the next chunk's transfer (megaft.parallel.tensor.overlap); equal to none to
    # fp32 rounding. Dense GQA/MLP blocks on torch's GEMMs (kernels.linear=triton|cuda, MLA, MoE, cp refused)
    tp_overlap: TPOverlap = TPOverlap.none
    backend: Backend = Backend.auto  # process-group backend: auto (nccl on GPU, gloo on CPU) | nccl | gloo
    # ZeRO stage over dp: 0 plain dp | 1 Adam state sharded | 2 grads too | 3 params too.
    # With dp=1 any stage is a no-op (every shard is the whole model).
    zero: int = 0
    bucket_mb: float = 25.0  # MiB of fp32 grads per dp reduction bucket; smaller = earlier overlap, more launches
    # none | cpu: fp32 master weights and Adam moments of this rank's shard in (pinned) host
    # memory, updated by the C++ AdamW (megaft.optim.offload); the device keeps no Adam moments (8 B/param, /dp)
    offload: Offload = Offload.none
    # dp gradient compression (megaft.parallel.data.compress): none | bf16 (half the bytes, bf16 sums)
    # | powersgd (rank-r factors with error feedback; zero 0/1 only)
    grad_compression: Compression = Compression.none
    powersgd_rank: int = 2  # r of PowerSGD's P (n x r) and Q (m x r); sends (n+m)r of n*m elements
    powersgd_warmup_steps: int = 0  # optimizer steps reduced uncompressed before PowerSGD starts


def resolve_dp(cfg: ParallelConfig, world_size: int) -> int:
    """dp as set, or derived from the world size when left unset."""
    if cfg.dp is not None:
        return cfg.dp
    return max(world_size // max(cfg.tp * cfg.cp * cfg.pp, 1), 1)


def check_parallel(cfg: ParallelConfig, world_size: int) -> list[str]:
    """Every problem with the parallel degrees against `world_size`, each with its fix."""
    errors = []
    for axis in ("tp", "cp", "pp", "dp", "ep"):
        value = getattr(cfg, axis)
        if value is not None and value < 1:
            errors.append(f"parallel.{axis}={value} must be >= 1; fix: set parallel.{axis} to a positive integer")
    if errors:
        return errors
    dp = resolve_dp(cfg, world_size)
    if cfg.tp * cfg.cp * cfg.pp * dp != world_size:
        derived = "" if cfg.dp is not None else " (dp derived as world_size // (tp*cp*pp))"
        cp, cp_n = ("*cp", f"*{cfg.cp}") if cfg.cp > 1 else ("", "")
        errors.append(
            f"world size {world_size} != tp*pp*dp{cp} = {cfg.tp}*{cfg.pp}*{dp}{cp_n}{derived}; "
            f"fix: start tp*cp*pp*dp ranks (launcher.nproc or Slurm tasks) or change parallel.tp/cp/pp/dp"
        )
    replicas = dp * cfg.cp
    if cfg.ep > 1 and replicas % cfg.ep:
        errors.append(f"parallel.ep={cfg.ep} must divide dp*cp = {dp}*{cfg.cp} = {replicas}: expert-parallel ranks "
                      f"are taken from the data-parallel replicas; fix: parallel.ep among the divisors of {replicas}, "
                      "or more ranks")
    if cfg.ep > 1 and cfg.grad_compression == "powersgd":
        errors.append("parallel.grad_compression=powersgd with parallel.ep>1 is not supported (expert gradients "
                      "reduce over their own group); fix: parallel.grad_compression=none or bf16")
    if cfg.zero not in (0, 1, 2, 3):
        errors.append(f"parallel.zero={cfg.zero} is unknown; fix: 0 (plain dp), 1, 2 or 3")
    if cfg.bucket_mb <= 0:
        errors.append(f"parallel.bucket_mb={cfg.bucket_mb} must be > 0; fix: e.g. parallel.bucket_mb=25")
    if cfg.offload not in set(Offload):  # a config built in Python
        errors.append(f"parallel.offload={cfg.offload!r} is unknown; fix: none or cpu")
    errors += _check_compression(cfg) + _check_tp_overlap(cfg)
    if cfg.backend not in set(Backend):
        errors.append(f"parallel.backend={cfg.backend!r} is unknown; fix: use auto, nccl or gloo")
    return errors


def _check_tp_overlap(cfg: ParallelConfig) -> list[str]:
    """parallel.tp_overlap against the layout (the model and kernels: megaft.validation)."""
    if cfg.tp_overlap not in set(TPOverlap):  # a config built in Python
        return [f"parallel.tp_overlap={cfg.tp_overlap!r} is unknown; fix: none or ring"]
    if cfg.tp_overlap == "none" or cfg.tp == 1:  # tp=1: nothing to overlap, as in a sweep over tp
        return []
    errors = []
    if not cfg.sequence_parallel:
        errors.append(f"parallel.tp_overlap=ring overlaps the sequence-parallel all-gather/reduce-scatter, and "
                      f"parallel.sequence_parallel=false at tp={cfg.tp} all-reduces instead; fix: "
                      "parallel.sequence_parallel=true, or parallel.tp_overlap=none")
    if cfg.cp > 1:
        errors.append(f"parallel.tp_overlap=ring with parallel.cp={cfg.cp} is not supported (the ring is tested "
                      "with the tp group alone); fix: parallel.cp=1, or parallel.tp_overlap=none")
    return errors


def _check_compression(cfg: ParallelConfig) -> list[str]:
    """parallel.grad_compression and the PowerSGD knobs."""
    if cfg.grad_compression not in set(Compression):
        return [f"parallel.grad_compression={cfg.grad_compression!r} is unknown; fix: none, bf16 or powersgd"]
    if cfg.grad_compression != "powersgd":
        return []
    errors = []
    if cfg.zero not in (0, 1):
        errors.append(f"parallel.grad_compression=powersgd needs all-reduced gradients, not parallel.zero="
                      f"{cfg.zero}'s sharded ones; fix: parallel.zero=0 or 1, or grad_compression=bf16")
    if cfg.powersgd_rank < 1:
        errors.append(f"parallel.powersgd_rank={cfg.powersgd_rank} must be >= 1; fix: e.g. parallel.powersgd_rank=2")
    if cfg.powersgd_warmup_steps < 0:
        errors.append(f"parallel.powersgd_warmup_steps={cfg.powersgd_warmup_steps} must be >= 0; "
                      "fix: 0 (compress from the first step) or more")
    return errors
