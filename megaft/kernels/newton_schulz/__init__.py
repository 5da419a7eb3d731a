"""Muon's Newton-Schulz orthogonalisation (optim.muon.ns_backend), with a choice of backend.

    torch   reference.py: torch.optim.Muon's ops in its order (the specification; fp32 runs
            equal torch.optim.Muon bitwise), its axpys already folded into addmm/baddbmm
    triton  triton.py: A = X X^T and b A + c A A^T as symmetric Triton GEMMs that compute the
            tiles on and above the diagonal only and mirror them, the axpy in the epilogue
    auto    triton on CUDA tensors when it imports, else torch (on CPU: torch)

An explicit backend that cannot run raises with the reason and the fix (megaft.kernels.dispatch).
"""
from __future__ import annotations

import torch

from megaft.config.optim import NS_BACKENDS  # optim.muon.ns_backend's choices
from megaft.kernels import _triton, dispatch
from megaft.kernels.newton_schulz.reference import zeropower_via_newtonschulz as reference_ns

__all__ = ["NS_BACKENDS", "newton_schulz", "resolve_backend"]


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch" or "triton") of the Newton-Schulz iteration on `device`."""
    if backend not in NS_BACKENDS:
        raise ValueError(f"newton_schulz backend must be one of {NS_BACKENDS}, got {backend!r}")
    return dispatch.resolve("newton_schulz", backend, device)


def newton_schulz(g: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float,
                  backend: str = "torch") -> torch.Tensor:
    """`steps` quintic Newton-Schulz iterations on the matrix or [E, rows, cols] stack `g` (bf16 out)."""
    if resolve_backend(backend, g.device) == "triton":
        return _triton.load("newton_schulz").zeropower_via_newtonschulz(g, a, b, c, steps, eps)
    return reference_ns(g, a, b, c, steps, eps)
