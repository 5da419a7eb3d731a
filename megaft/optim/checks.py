"""check_fused: whether an explicit `optim.fused` kernel can run on the run's device (never a
silent fallback to another kernel); check_muon_layout: the layouts optim.name=muon runs. The
values' own checks are megaft.config.optim's. No torch here: the planner imports this."""
from __future__ import annotations

from megaft.config.optim import OptimConfig
from megaft.device import resolve_device


def check_fused(cfg: OptimConfig, device: str | None = None) -> list[str]:
    """Problems of optim.fused on ``device`` (the run's auto|cpu|cuda): the extension of an
    explicit cpu/cuda kernel must be built, and Triton must be able to run there; the same for
    optim.muon.ns_backend=triton under optim.name=muon."""
    errors = check_ns_backend(cfg, device)
    if cfg.fused == "triton":
        return errors + _check_fused_triton(device)
    if cfg.fused in ("cpu", "cuda"):
        from megaft.kernels import _ext

        ext = _ext.C if cfg.fused == "cpu" else _ext.CUDA
        if not ext.available:
            errors.append(f"optim.fused={cfg.fused}: {ext.name} is not available ({ext.error}); fix: rebuild "
                          "with `pip install --no-build-isolation -e .` (MEGAFT_CUDA=1 for CUDA) or optim.fused=auto")
    return errors


def check_ns_backend(cfg: OptimConfig, device: str | None = None) -> list[str]:
    """optim.muon.ns_backend=triton (optim.name=muon) needs triton, and CUDA tensors unless Triton's CPU
    interpreter is on (tests): never a silent fallback to the torch iteration."""
    if cfg.name != "muon" or cfg.muon.ns_backend != "triton":
        return []
    return _triton_problems("optim.muon.ns_backend=triton", "optim.muon.ns_backend=torch or auto", device)


def _check_fused_triton(device: str | None) -> list[str]:
    """optim.fused=triton needs triton, and CUDA tensors unless Triton's CPU
    interpreter is on (tests): never a silent fallback to another kernel."""
    return _triton_problems("optim.fused=triton", "optim.fused=auto", device)


def _triton_problems(setting: str, fix: str, device: str | None) -> list[str]:
    """`setting` needs Triton on this run's device: why it cannot run there, with the fix."""
    import torch

    from megaft.kernels import _triton

    on_cuda = resolve_device(device) == "cuda"
    why = _triton.unavailable_reason(torch.device("cuda" if on_cuda else "cpu"))
    if why is None:
        return []
    return [f"{setting} cannot run on this run's {'cuda' if on_cuda else 'cpu'} device: {why}. fix: {fix} "
            "(or run on GPUs)"]


def check_muon_layout(cfg) -> list[str]:
    """optim.name=muon's layouts: those this version runs exactly (docs/optimizers.md). Every layout
    AdamW runs does now (master weights, offload, copied kv heads and LoRA on a mixture of experts
    included); validation and the planner keep calling this for the next one Muon does not cover."""
    return []
