"""TRL 1.16's generalized_jsd_loss (GKDTrainer.generalized_jsd_loss, the DistillationTrainer's
divergence), vocab-parallel: each tp rank holds its slice [vocab_start, vocab_start + V/tp) of both
models' logits, and nothing of size [tokens x vocab] is ever gathered.

The log-softmax of a slice is z - max - log(sum exp(z - max)), with the max all-reduced (MAX, no
grad: the log-softmax does not depend on it) and the sum of exps all-reduced both ways (its
gradient is every rank's, summed: `_sum_over`). That is the pair of per-token reductions megaft's
vocab-parallel cross-entropy uses (megaft.kernels.cross_entropy.reference). The divergence terms
are elementwise in the vocabulary (torch's kl_div with log targets, TRL's own expressions), summed
over the rank's slice and then over tp (reduce_from_tp: Megatron's g). Padding columns past the
true vocabulary are dropped, never masked (a -inf log-prob would make 0 x inf).

Per token, with s = log_softmax(student / T), t = log_softmax(teacher / T):
  beta = 0: KL(teacher || student) = sum exp(t) (t - s)       (forward KL)
  beta = 1: KL(student || teacher) = sum exp(s) (s - t)       (reverse KL)
  else:     m = logsumexp(s + log(1 - beta), t + log beta),
            beta KL(teacher || m) + (1 - beta) KL(student || m)
No T^2 factor (TRL has none). Tokens go through in chunks of `chunk` rows, each recomputed in the
backward (activation checkpointing), so the fp32 log-probs of both models are held for one chunk.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megaft.kernels.cross_entropy.reference import IGNORE_INDEX
from megaft.parallel.comm import Group, group_rank, group_size
from megaft.parallel.tensor.comm import reduce_from_tp

__all__ = ["token_divergence", "vocab_log_softmax"]


class _SumOver(torch.autograd.Function):
    """All-reduce (sum) forward and backward: a value every rank's slice contributes to and every
    rank's terms read (the softmax's normaliser)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _SumOver.apply(x, group)


def vocab_log_softmax(z: torch.Tensor, group: Group = None) -> torch.Tensor:
    """log_softmax over the whole vocabulary of this rank's slice `z` [N, V_local] (fp32)."""
    # a slice of padding columns only (a small vocabulary padded to Megatron's 128 x tp) has no max of its own
    top = z.detach().amax(-1, keepdim=True) if z.shape[-1] else z.new_full((*z.shape[:-1], 1), float("-inf"))
    if group_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = z - top
    return shifted - _sum_over(shifted.exp().sum(-1, keepdim=True), group).log()


def _divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float,
                group: Group) -> torch.Tensor:
    """The per-token generalized JSD [N] of one chunk (this rank's slice, summed over tp)."""
    s = vocab_log_softmax(student.float() / temperature, group)
    t = vocab_log_softmax(teacher.float() / temperature, group)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype, device=s.device)
        mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(mixture, t, reduction="none", log_target=True) + \
            (1 - b) * F.kl_div(mixture, s, reduction="none", log_target=True)
    return jsd.sum(-1)


def token_divergence(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, *, beta: float,
                     temperature: float = 1.0, group: Group = None, vocab_size: Optional[int] = None,
                     chunk: int = 1024) -> torch.Tensor:
    """The generalized JSD of every target token [batch, seq] (fp32, 0 where labels == -100), from
    this tp rank's vocabulary slices of the student's logits (with grad) and the teacher's (no grad),
    each [batch, seq, V/tp]; megaft labels (labels[:, t] is position t's target, already shifted).
    `vocab_size`: the true vocabulary (the padding columns are no token)."""
    local = student.shape[-1]
    start = group_rank(group) * local
    real = local if vocab_size is None else max(0, min(local, vocab_size - start))
    s, t = student.reshape(-1, local)[:, :real], teacher.detach().reshape(-1, local)[:, :real]
    flat = labels.reshape(-1)
    rows = (flat != IGNORE_INDEX).nonzero().squeeze(-1)  # the same rows on every tp rank
    out = torch.zeros(flat.shape, dtype=torch.float32, device=student.device)
    parts = []
    for idx in rows.split(max(1, chunk)):
        args = (s.index_select(0, idx), t.index_select(0, idx), beta, temperature, group)
        parts.append(checkpoint(_divergence, *args, use_reentrant=False) if s.requires_grad else _divergence(*args))
    if parts:
        out = out.index_put((rows,), reduce_from_tp(torch.cat(parts), group))
    return out.view(labels.shape)
