"""Vocabulary-parallel cross-entropy, plain or fused with the head projection.

    torch   reference.py: the specification (vocab_parallel_cross_entropy, fp32 logits copy)
            and, for the fused path, chunked.py's torch statistics (fp32 per row chunk only)
    triton  triton.py: online-logsumexp statistics and the gradient, in the logits' dtype
    cuda    cuda.py: the same in CUDA C++ (csrc/cuda/cross_entropy.cu, torch.ops.megaft.cross_entropy_*)

``linear_cross_entropy`` computes ``hidden @ weight.T`` and the loss ``chunk`` tokens at a
time (chunked.py), so the logits of the whole batch never exist; its torch backend is
chunked too (the unfused pair is ``reference.linear_cross_entropy``). Both work with the
vocabulary split over tp (``group``, ``vocab_start``); the hidden gradient is this rank's
partial sum, reduced by the caller's copy_to_tp (as for the unfused head).

Backend choice: ``megaft.kernels.dispatch.resolve`` (auto = triton, else cuda, on CUDA
tensors; torch on CPU).
"""

from __future__ import annotations

import functools

import torch

from megaft.kernels import dispatch
from megaft.kernels.cross_entropy import chunked, reference

__all__ = ["cross_entropy", "linear_cross_entropy", "resolve_backend"]

# "torch", "triton" or "cuda" for a device (the shared rule: auto, explicit, errors).
resolve_backend = functools.partial(dispatch.resolve, "cross_entropy")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, group=None, vocab_start: int = 0,
                  vocab_size: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Per-token loss [N] (0 where labels == -100) from this rank's logits [N, V_local];
    ``vocab_size`` is the true vocabulary (columns past it are padding)."""
    vocab_size = vocab_start + logits.shape[-1] if vocab_size is None else vocab_size
    impl = resolve_backend(backend, logits.device)
    if impl != "torch":
        return chunked.CrossEntropy.apply(logits, labels, group, vocab_start, vocab_size, impl)
    return reference.cross_entropy(logits, labels, group=group, vocab_start=vocab_start, vocab_size=vocab_size)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, group=None,
                         vocab_start: int = 0, vocab_size: int | None = None, backend: str = "auto",
                         chunk: int = 2048) -> torch.Tensor:
    """Per-token loss [N] of ``hidden [N, D] @ weight[V_local, D].T`` without the [N, V_local]
    logits: ``chunk`` tokens' logits at a time (peak ~ chunk * V_local extra elements)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, D] and weight [V_local, D] expected, got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    vocab_size = vocab_start + weight.shape[0] if vocab_size is None else vocab_size
    impl = resolve_backend(backend, hidden.device)
    return chunked.LinearCrossEntropy.apply(hidden, weight, labels, group, vocab_start, vocab_size, impl, chunk)
