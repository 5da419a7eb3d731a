"""Vocabulary-parallel cross-entropy in torch: the specification the other backends are
tested against.

``cross_entropy`` is :func:`megaft.layers.cross_entropy.vocab_parallel_cross_entropy`
(fp32 copy of the logits, Megatron's three per-token all-reduces).
``linear_cross_entropy`` is the unfused pair the fused kernel replaces: the head's
projection ``hidden @ weight.T`` (this rank's vocabulary rows), then the loss.
"""

from __future__ import annotations

import torch

from megaft.layers.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy

__all__ = ["IGNORE_INDEX", "cross_entropy", "linear_cross_entropy"]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, group, vocab_start: int,
                  vocab_size: int) -> torch.Tensor:
    """Per-token loss [N] (0 where labels == -100) from local logits [N, V_local]."""
    return vocab_parallel_cross_entropy(logits, labels, group=group, vocab_start=vocab_start,
                                        vocab_size=vocab_size)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, group,
                         vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Per-token loss [N] of ``hidden [N, D] @ weight[V_local, D].T`` (all logits at once)."""
    return cross_entropy(hidden @ weight.t(), labels, group=group, vocab_start=vocab_start,
                         vocab_size=vocab_size)
