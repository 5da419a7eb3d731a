"""RMSNorm, optionally with the residual add fused in front, with a choice of backend.

    torch   reference.py: torch ops, the specification (= megaft.layers.norm.RMSNorm)
    triton  triton.py: one-row-per-program forward, dx + partial-dw backward

``backend="auto"`` takes triton for CUDA tensors when triton imports, else torch
(the CPU path stays torch), and logs that choice once. An explicit backend that
cannot run raises with the reason, never a silent fallback; on CPU, triton runs
only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch

from megaft.kernels import _triton
from megaft.kernels.rmsnorm import reference

__all__ = ["BACKENDS", "rmsnorm", "resolve_backend"]

BACKENDS = _triton.BACKENDS


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch" or "triton") for tensors on ``device``."""
    return _triton.resolve("rmsnorm", backend, device)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, backend: str = "auto",
            *, residual: torch.Tensor | None = None):
    """``weight * x / rms(x)`` over the last dim (normalized in fp32, cast back to
    ``x.dtype`` before the weight multiply). With ``residual`` (same shape and dtype
    as ``x``) returns ``(rmsnorm(x + residual), x + residual)``."""
    if resolve_backend(backend, x.device) == "triton":
        return _triton.load("rmsnorm").rmsnorm(x, weight, eps, residual)
    return reference.rmsnorm(x, weight, eps, residual)
