"""Vocabulary-parallel cross-entropy in torch: the specification the other backends are
tested against.

Each rank holds logits for its slice [vocab_start, vocab_start + V/tp) of the
padded vocabulary. Three small all-reduces over tp (max, target logit, sum of
exps; one number per token each) give the exact softmax cross-entropy
(Megatron's _VocabParallelCrossEntropy). Columns past the true vocabulary size
(padding) are masked to -inf, so padding never changes the loss.

``linear_cross_entropy`` is the unfused pair the fused kernel replaces: the head's
projection ``hidden @ weight.T`` (this rank's vocabulary rows), then the loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megaft.parallel.comm import Group, group_size

__all__ = ["IGNORE_INDEX", "cross_entropy", "linear_cross_entropy", "vocab_parallel_cross_entropy"]

IGNORE_INDEX = -100


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, vocab_size):
        x = logits.float()
        local = x.shape[-1]
        real = max(0, min(local, vocab_size - vocab_start))
        if real < local:  # padded columns: never a prediction, never a target
            x = x.clone()
            x[:, real:] = float("-inf")
        # Max for a stable exp; exact under any reduction order (max is associative).
        max_logit = x.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        x = x - max_logit.unsqueeze(-1)

        valid = labels != IGNORE_INDEX
        local_label = labels - vocab_start
        mine = valid & (local_label >= 0) & (local_label < local)
        rows = torch.arange(x.shape[0], device=x.device)
        target = torch.where(mine, x[rows, local_label.clamp(0, local - 1)], torch.zeros_like(max_logit))

        exp = x.exp()
        sum_exp = exp.sum(dim=-1)
        if group_size(group) > 1:
            # One all-reduce for both per-token quantities.
            both = torch.stack([target, sum_exp])
            dist.all_reduce(both, group=group)
            target, sum_exp = both[0], both[1]
        loss = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target))

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_label, mine, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_label, mine, valid = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_label.clamp(0, grad.shape[-1] - 1)] -= mine.to(grad.dtype)
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, group: Group,
                                 vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Per-token loss [N] (0 where labels == -100) from local logits [N, V_local].

    `vocab_start` is this rank's first vocabulary id; `vocab_size` the true
    (unpadded) vocabulary, so padded columns are excluded.
    """
    return _VocabParallelCE.apply(logits, labels, group, vocab_start, vocab_size)


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
