"""Fused AdamW step over flat fp32 buffers, with a choice of backend.

    torch  reference.py: torch ops, the specification (equals torch.optim.AdamW)
    cpu    megaft._C: one threaded, vectorized pass (optimizer offload)
    cuda   megaft._cuda: one kernel on the current stream

``backend="auto"`` takes the compiled backend for the tensor's device when it was
built, else torch, and logs that choice once. An explicit backend that is not
available raises (never a silent fallback), with the original import error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from megaft.kernels import _ext
from megaft.kernels.adamw import cpu, cuda, reference

__all__ = ["BACKENDS", "adamw_step_", "resolve_backend"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpu", "cuda")
_IMPLS: dict[str, Callable[..., None]] = {
    "torch": reference.adamw_step_,
    "cpu": cpu.adamw_step_,
    "cuda": cuda.adamw_step_,
}
_EXT_OF = {"cpu": _ext.C, "cuda": _ext.CUDA}
_logged: set[tuple[str, str]] = set()


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch", "cpu" or "cuda") for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"adamw backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        if backend in _EXT_OF:
            _ext.require(_EXT_OF[backend], f"adamw backend {backend!r}")
        return backend
    compiled = {"cpu": "cpu", "cuda": "cuda"}.get(device.type)
    choice = compiled if compiled and _EXT_OF[compiled].available else "torch"
    if (device.type, choice) not in _logged:
        _logged.add((device.type, choice))
        why = "" if choice != "torch" or not compiled else f" ({_EXT_OF[compiled].error})"
        log.info("adamw backend=auto on %s: using %r%s", device.type, choice, why)
    return choice


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float,
                backend: str = "auto") -> None:
    """One AdamW step (decoupled weight decay, bias correction) in place on
    ``param``, ``exp_avg`` and ``exp_avg_sq``; ``step`` is 1 on the first update.

    All four tensors are contiguous float32 of one shape on one device; the math
    and its rounding are those of ``torch.optim.AdamW(foreach=False)``.
    """
    impl = _IMPLS[resolve_backend(backend, param.device)]
    impl(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
         eps=eps, weight_decay=weight_decay)
