"""check_kernels: whether each op's asked-for backend (`kernels.*`) can run on the run's device,
and the autotune cache's path, each problem with its fix (megaft.kernels.dispatch decides)."""
from __future__ import annotations

from megaft.config.kernels import BACKENDS, CUDA_OPS, OPS, KernelsConfig
from megaft.device import resolve_device


def check_kernels(cfg: KernelsConfig, device: str) -> list[str]:
    """Every problem of `cfg` for a run on `device` (the setting: auto | cpu | cuda), with its fix.
    The device is resolved, and torch imported, only when an op asks for an explicit backend."""
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
    explicit = [op for op in OPS if cfg.for_op(op) not in ("auto", "torch")]
    if not explicit:  # nothing the device could refuse
        return problems
    import torch

    from megaft.kernels import dispatch

    device_type = resolve_device(device)
    blocked: dict[tuple[str, str, str], list[str]] = {}  # (source, backend, why) -> ops: one line each
    for op in explicit:
        asked = cfg.for_op(op)
        source = f"kernels.{op}" if getattr(cfg, op) else "kernels.backend"
        if asked == "cuda" and op not in CUDA_OPS:
            problems.append(f"{source}=cuda: {op} has no CUDA C++ kernel; fix: kernels.{op}=triton, auto or torch")
            continue
        why = dispatch.unavailable_reason(op, asked, torch.device(device_type))
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
