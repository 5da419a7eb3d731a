"""SwiGLU's activation ``silu(gate) * up``, with a choice of backend.

    torch   reference.py: torch ops, the specification
    triton  triton.py: elementwise forward and backward kernels

``backend="auto"`` takes triton for CUDA tensors when triton imports, else torch
(the CPU path stays torch), and logs that choice once. An explicit backend that
cannot run raises with the reason, never a silent fallback; on CPU, triton runs
only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch

from megaft.kernels import _triton
from megaft.kernels.swiglu import reference

__all__ = ["BACKENDS", "swiglu", "resolve_backend"]

BACKENDS = _triton.BACKENDS


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch" or "triton") for tensors on ``device``."""
    return _triton.resolve("swiglu", backend, device)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` elementwise; ``gate`` and ``up`` have one shape and dtype."""
    if resolve_backend(backend, gate.device) == "triton":
        return _triton.load("swiglu").swiglu(gate, up)
    return reference.swiglu(gate, up)
