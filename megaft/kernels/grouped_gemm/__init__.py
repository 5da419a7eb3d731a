"""The grouped GEMM of a mixture of experts (tokens sorted by expert, one matmul per
projection for every expert at once), with a choice of backend.

    torch   reference.py: a loop over the groups, F.linear on each slice; the specification
    triton  triton.py: one grouped kernel for y and dx (the group offsets read on the
            device), one for the weight gradient
    cuda    cuda.py: torch._grouped_mm, torch's own CUDA grouped GEMM (CUTLASS for bf16 on
            sm90/sm100); not megaft._cuda. CUDA tensors only: on the CPU torch's op is a
            per-group loop like the reference (cuda.py says why it is not offered there)

Backend choice: ``megaft.kernels.dispatch.resolve`` (auto = triton, else cuda, on CUDA
tensors; torch on CPU).
"""

from __future__ import annotations

import functools

import torch

from megaft.kernels import _triton, dispatch
from megaft.kernels.grouped_gemm import cuda, reference

__all__ = ["grouped_mm", "resolve_backend"]

# The shared dispatch rule (auto, explicit, errors) with this op's name in messages.
resolve_backend = functools.partial(dispatch.resolve, "grouped_gemm")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g].T``: x [N, K] with its rows sorted by group,
    w [G, M, K] (one nn.Linear weight per group), counts [G] the rows of each group (an
    int64 CPU tensor; zeros allowed; sums to N) -> y [N, M]. Differentiable in x and w; a
    group without rows gets a zero weight gradient. Under autocast the compiled backends
    take x and w cast to the autocast dtype, as F.linear does."""
    _check(x, w, counts)
    choice = resolve_backend(backend, x.device)
    if choice == "torch":
        return reference.grouped_mm(x, w, counts)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_mm: x and w need one dtype on backend {choice!r}, got {x.dtype} and {w.dtype}")
    if choice == "triton":
        return _triton.load("grouped_gemm").grouped_mm(x, w, counts)
    return cuda.grouped_mm(x, w, counts)


def _check(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_mm needs x [N, K] and w [G, M, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if counts.dim() != 1 or counts.numel() != w.shape[0] or counts.is_floating_point() or counts.device.type != "cpu":
        raise ValueError(f"grouped_mm needs counts as an integer CPU tensor of the {w.shape[0]} groups' rows, "
                         f"got {counts.dtype} {tuple(counts.shape)} on {counts.device}")
    if w.shape[0] == 0 or int(counts.sum()) != x.shape[0] or bool((counts < 0).any()):
        raise ValueError(f"grouped_mm: counts {counts.tolist()} must be >= 0 and sum to x's {x.shape[0]} rows "
                         "(at least one group)")
