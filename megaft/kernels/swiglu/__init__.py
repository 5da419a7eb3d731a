"""SwiGLU's activation ``silu(gate) * up``, with a choice of backend.

    torch   reference.py: torch ops, the specification
    triton  triton.py: elementwise forward and backward kernels
    cuda    cuda.py: torch.ops.megaft.swiglu_{fwd,bwd} (csrc/cuda/swiglu.cu)

Backend choice: ``megaft.kernels.dispatch.resolve`` (auto = triton, else cuda, on CUDA
tensors; torch on CPU).
"""

from __future__ import annotations

import functools

import torch

from megaft.kernels import _triton, dispatch
from megaft.kernels.swiglu import cuda, reference

__all__ = ["swiglu", "resolve_backend"]

# The shared dispatch rule (auto, explicit, errors) with this op's name in messages.
resolve_backend = functools.partial(dispatch.resolve, "swiglu")


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` elementwise; ``gate`` and ``up`` have one shape and dtype."""
    choice = resolve_backend(backend, gate.device)
    if choice == "triton":
        return _triton.load("swiglu").swiglu(gate, up)
    if choice == "cuda":
        return cuda.swiglu(gate, up)
    return reference.swiglu(gate, up)
