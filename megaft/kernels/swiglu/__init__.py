"""SwiGLU's activation ``silu(gate) * up``, with a choice of backend.

    torch   reference.py: torch ops, the specification
    triton  triton.py: elementwise forward and backward kernels

Backend choice: ``megaft.kernels._triton.resolve`` (auto = triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import functools

import torch

from megaft.kernels import _triton
from megaft.kernels.swiglu import reference

__all__ = ["swiglu", "resolve_backend"]

# The shared dispatch rule (auto, explicit, errors) with this op's name in messages.
resolve_backend = functools.partial(_triton.resolve, "swiglu")


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` elementwise; ``gate`` and ``up`` have one shape and dtype."""
    if resolve_backend(backend, gate.device) == "triton":
        return _triton.load("swiglu").swiglu(gate, up)
    return reference.swiglu(gate, up)
