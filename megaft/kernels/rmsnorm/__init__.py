"""RMSNorm, optionally with the residual add fused in front, with a choice of backend.

    torch   reference.py: torch ops, the specification (= megaft.layers.norm.RMSNorm)
    triton  triton.py: one-row-per-program forward, dx + partial-dw backward
    cuda    cuda.py: torch.ops.megaft.rmsnorm_{fwd,bwd} (csrc/cuda/rmsnorm.cu)

Backend choice: ``megaft.kernels.dispatch.resolve`` (auto = triton, else cuda, on CUDA
tensors; torch on CPU).
"""

from __future__ import annotations

import functools

import torch

from megaft.kernels import _triton, dispatch
from megaft.kernels.rmsnorm import cuda, reference

__all__ = ["rmsnorm", "resolve_backend"]

# The shared dispatch rule (auto, explicit, errors) with this op's name in messages.
resolve_backend = functools.partial(dispatch.resolve, "rmsnorm")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, backend: str = "auto",
            *, residual: torch.Tensor | None = None):
    """``weight * x / rms(x)`` over the last dim (normalized in fp32, cast back to
    ``x.dtype`` before the weight multiply). With ``residual`` (same shape and dtype
    as ``x``) returns ``(rmsnorm(x + residual), x + residual)``."""
    choice = resolve_backend(backend, x.device)
    if choice == "triton":
        return _triton.load("rmsnorm").rmsnorm(x, weight, eps, residual)
    if choice == "cuda":
        return cuda.rmsnorm(x, weight, eps, residual)
    return reference.rmsnorm(x, weight, eps, residual)
