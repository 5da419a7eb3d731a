"""KernelsConfig (`kernels.*`): which backend runs each fused op of the model, and its checks.

``kernels.backend`` applies to every op; a per-op field overrides it (None = follow
``backend``). ``auto`` keeps the CPU path on torch; on CUDA it runs, per op, the available
backend measured fastest on the run's shapes (``autotune``, megaft.kernels.autotune), or
with ``autotune=false`` Triton, else the CUDA C++ kernels, else torch
(megaft.kernels.dispatch). An explicit backend that
cannot run on the run's device is reported by :func:`check_kernels` before any rank
starts, with the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from megaft.kernels.dispatch import BACKENDS

OPS = ("rmsnorm", "rope", "swiglu", "cross_entropy", "linear", "grouped_gemm")
# auto | torch | triton | cuda (megaft.kernels.dispatch), as an enum Hydra checks when composing
KernelBackend = StrEnum("KernelBackend", [(b, b) for b in BACKENDS])


@dataclass
class KernelsConfig:
    backend: KernelBackend = KernelBackend.auto  # auto | torch | triton | cuda, every op without an override
    rmsnorm: Optional[KernelBackend] = None  # RMSNorm (+ the fused residual add); None = `backend`
    rope: Optional[KernelBackend] = None  # rotary embedding of q and k; None = `backend`
    swiglu: Optional[KernelBackend] = None  # the MLP's silu(gate) * up; None = `backend`
    cross_entropy: Optional[KernelBackend] = None  # vocab-parallel loss; None = `backend`
    linear: Optional[KernelBackend] = None  # parallel linears: GEMM + epilogue, wgrad fused into the main grad
    grouped_gemm: Optional[KernelBackend] = None  # MoE experts' grouped GEMMs (cuda: torch._grouped_mm)
    fused_linear_cross_entropy: bool = False  # head projection + loss chunk by chunk (never all logits)
    ce_chunk_tokens: int = 2048  # tokens per chunk of the fused linear cross-entropy
    autotune: bool = True  # auto on CUDA: time the available backends once per shape (false: fixed order)
    autotune_cache: str = ""  # JSON file of measured choices; "" = $MEGAFT_CACHE_DIR or ~/.cache/megaft

    def for_op(self, op: str) -> str:
        """The backend asked for `op`: the override, else `backend` (a global cuda
        means auto for the ops without a CUDA C++ kernel)."""
        if op not in OPS:
            raise ValueError(f"unknown kernel op {op!r}; one of {OPS}")
        override = getattr(self, op)
        if override:
            return override
        return "auto" if self.backend == "cuda" and op not in CUDA_OPS else self.backend


# Ops with a cuda backend: a CUDA C++ kernel (linear's: the cuBLASLt forward GEMM + epilogue and the cuBLAS
# wgrad accumulation), or for grouped_gemm torch's own torch._grouped_mm (dispatch.TORCH_CUDA_OPS).
CUDA_OPS = ("rmsnorm", "rope", "swiglu", "cross_entropy", "linear", "grouped_gemm")


def check_kernels(cfg: KernelsConfig, device_type: str) -> list[str]:
    """Every problem of `cfg` for a run on `device_type` ("cpu" or "cuda"), with its fix."""
    import torch

    from megaft.kernels import dispatch

    problems = []
    for name in ("backend",) + OPS:
        value = getattr(cfg, name)
        if value is not None and value not in BACKENDS:
            problems.append(f"kernels.{name}={value!r} is unknown; fix: one of {', '.join(BACKENDS)}")
    if problems:
        return problems
    if cfg.ce_chunk_tokens < 1:
        problems.append(f"kernels.ce_chunk_tokens={cfg.ce_chunk_tokens} must be >= 1")
    problems += _cache_problems(cfg)
    device = torch.device(device_type)
    blocked: dict[tuple[str, str, str], list[str]] = {}  # (source, backend, why) -> ops: one line each
    for op in OPS:
        asked = cfg.for_op(op)
        if asked in ("auto", "torch"):
            continue
        source = f"kernels.{op}" if getattr(cfg, op) else "kernels.backend"
        if asked == "cuda" and op not in CUDA_OPS:
            problems.append(f"{source}=cuda: {op} has no CUDA C++ kernel; fix: kernels.{op}=triton, auto or torch")
            continue
        why = dispatch.unavailable_reason(op, asked, device)
        if why is not None:
            blocked.setdefault((source, asked, why), []).append(op)
    for (source, asked, why), ops in blocked.items():
        problems.append(f"{source}={asked} cannot run {', '.join(ops)} on {device_type}: {why} "
                        "(kernels.backend=auto is torch on CPU)")
    return problems


def _cache_problems(cfg: KernelsConfig) -> list[str]:
    """kernels.autotune_cache must name a file that rank 0 can create or rewrite."""
    import os

    if not cfg.autotune or not cfg.autotune_cache:
        return []
    path = os.path.abspath(os.path.expanduser(cfg.autotune_cache))
    if os.path.isdir(path):
        return [f"kernels.autotune_cache={cfg.autotune_cache!r} is a directory; "
                "fix: a file path such as <dir>/kernel_choice.json"]
    parent = os.path.dirname(path)
    while not os.path.exists(parent):  # created on first write: the nearest existing folder decides
        parent = os.path.dirname(parent)
    target = path if os.path.exists(path) else parent
    if not os.path.isdir(parent) or not os.access(target, os.W_OK):
        return [f"kernels.autotune_cache={cfg.autotune_cache!r} is not writable here; "
                "fix: a writable path, '' for the default, or kernels.autotune=false"]
    return []
