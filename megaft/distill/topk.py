"""The teacher stored as its top-k log-probs per target token (distill.top_k), and the divergence
against it, vocab-parallel.

The definition: per target token, the vocabulary is partitioned into the teacher's k most likely
ids and one bucket holding every other id (the tail). Both distributions are coarsened to those
k + 1 outcomes: the teacher's as stored (k log-probs and the log of its tail mass), the student's
from its full distribution (its log-probs at the k ids, and the log of the mass it puts on every
other id). The loss is TRL's generalized JSD (megaft.distill.losses, the same beta and
temperature) between the two coarsened distributions. Keeping the tail as an outcome keeps it a
divergence of two distributions (no renormalization; Dasgupta et al. 2026, arXiv 2602.20816,
likewise treat the teacher's top-K and its tail as separate terms). By the data-processing
inequality of f-divergences (the generalized JSD is one), coarsening never increases it: the
top-k loss is at most the full-vocabulary one, grows with k (top-(k+1) refines top-k) and equals
it at k = vocabulary, where the tail is empty (log 0 = -inf, its terms 0).

Vocab-parallel as megaft.distill.losses: each tp rank holds its slice of the student's logits; the
student's log-probs at the teacher's ids are read from the slice that holds each id and summed over
tp (reduce_from_tp: each id lives on one rank), and its tail mass is each slice's mass off the k
ids, summed over tp; nothing of size [tokens x vocab] is gathered. Those sums are replicated, so
the divergence is computed whole on every rank (the same value, as token_divergence returns).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megaft.distill.losses import vocab_log_softmax
from megaft.kernels.cross_entropy.reference import IGNORE_INDEX
from megaft.parallel.comm import Group, group_rank, group_size
from megaft.parallel.tensor.comm import reduce_from_tp

__all__ = ["TopK", "bucket_divergence", "teacher_topk", "topk_divergence"]

NEG_INF = float("-inf")


class TopK(NamedTuple):
    """A teacher's top-k per target token: ids [N, k] (int64, global vocabulary ids, most likely
    first), logps [N, k] and tail [N] (fp32, log of the mass off the k ids; -inf when none)."""

    ids: torch.Tensor
    logps: torch.Tensor
    tail: torch.Tensor


def _slice(logits: torch.Tensor, group: Group, vocab_size: Optional[int]) -> tuple[torch.Tensor, int]:
    """This rank's real columns [N, real] (padding past the vocabulary dropped) and their first id."""
    local = logits.shape[-1]
    start = group_rank(group) * local
    real = local if vocab_size is None else max(0, min(local, vocab_size - start))
    return logits.reshape(-1, local)[:, :real], start


def _owned(ids: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of `ids` this slice holds, and their column in it (0 where not held)."""
    held = (ids >= start) & (ids < start + width)
    return held, torch.where(held, ids - start, torch.zeros_like(ids))


def _off_mask(ids: torch.Tensor, held: torch.Tensor, cols: torch.Tensor, width: int) -> torch.Tensor:
    """[N, width] True at this slice's columns that are none of the token's k ids (the tail)."""
    # a count, not a scatter of booleans: ids held elsewhere all point at column 0, and a scatter with
    # repeated indices keeps an arbitrary one of their values
    hits = torch.zeros(ids.shape[0], width, dtype=torch.int32, device=ids.device)
    return hits.scatter_add(1, cols, held.int()) == 0 if width else hits.bool()


def _tail(logp: torch.Tensor, off: torch.Tensor, group: Group) -> torch.Tensor:
    """log of the mass of the `off` columns over the whole vocabulary [N]; -inf when there are none.
    In the log domain with a max taken over tp, so a small tail does not underflow; the empty case
    goes through a finite branch (log 0's gradient would make 0 x inf = nan)."""
    top = torch.where(off, logp.detach(), torch.full_like(logp, NEG_INF)).amax(-1) if logp.shape[-1] else \
        logp.new_full(logp.shape[:1], NEG_INF)
    if group_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    empty = top == NEG_INF
    top = torch.where(empty, torch.zeros_like(top), top)
    # masked before the exp: a top-k column may lie far above the tail's max (exp would overflow)
    mass = reduce_from_tp(torch.where(off, logp - top[:, None], NEG_INF).exp().sum(-1), group)
    return torch.where(empty, torch.full_like(top, NEG_INF), torch.where(empty, 1.0, mass).log() + top)


@torch.no_grad()
def teacher_topk(teacher: torch.Tensor, k: int, *, temperature: float = 1.0, group: Group = None,
                 vocab_size: Optional[int] = None) -> TopK:
    """The top-k of the teacher's log_softmax(logits / T) for every row of this rank's slice
    [N, V/tp]: each slice's own top-k, gathered over tp (k per rank) and cut to the global top-k."""
    z, start = _slice(teacher.float() / temperature, group, vocab_size)
    logp = vocab_log_softmax(z, group)
    values, cols = logp.topk(min(k, z.shape[-1]), dim=-1)
    ids = cols + start
    if group_size(group) > 1:
        # pad each rank's candidates to k (a slice narrower than k), so the all_gather's shapes agree
        pad = k - values.shape[-1]
        values = torch.cat([values, values.new_full((values.shape[0], pad), NEG_INF)], -1)
        ids = torch.cat([ids, ids.new_full((ids.shape[0], pad), -1)], -1)
        all_values = [torch.empty_like(values) for _ in range(group_size(group))]
        all_ids = [torch.empty_like(ids) for _ in range(group_size(group))]
        dist.all_gather(all_values, values, group=group)
        dist.all_gather(all_ids, ids, group=group)
        values, pick = torch.cat(all_values, -1).topk(k, dim=-1)
        ids = torch.cat(all_ids, -1).gather(1, pick)
    held, cols = _owned(ids, start, z.shape[-1])
    tail = _tail(logp, _off_mask(ids, held, cols, z.shape[-1]), group)
    return TopK(ids, values, tail)


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum exp(p) (p - q) over the last dim, a term 0 where p = -inf (an empty outcome)."""
    empty = p == NEG_INF
    p0, q0 = torch.where(empty, 0.0, p), torch.where(empty, 0.0, q)
    return torch.where(empty, 0.0, p0.exp() * (p0 - q0)).sum(-1)


def bucket_divergence(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized JSD [N] between two distributions given as log-probs over the same outcomes
    [N, k + 1] (here the k ids and the tail), either of which may hold -inf."""
    if beta == 0:
        return _kl(t, s)
    if beta == 1:
        return _kl(s, t)
    both = (s == NEG_INF) & (t == NEG_INF)  # an outcome neither has (the empty tail): no term
    s, t = torch.where(both, 0.0, s), torch.where(both, 0.0, t)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    s, t = torch.where(both, NEG_INF, s), torch.where(both, NEG_INF, t)
    return b * _kl(t, mixture) + (1 - b) * _kl(s, mixture)


def _chunk_divergence(student: torch.Tensor, ids: torch.Tensor, logps: torch.Tensor, tail: torch.Tensor,
                      start: int, beta: float, temperature: float, group: Group) -> torch.Tensor:
    s = vocab_log_softmax(student.float() / temperature, group)
    held, cols = _owned(ids, start, s.shape[-1])
    # each id from its one slice (a slice of padding columns only holds none and has nothing to gather)
    mine = torch.where(held, s.gather(1, cols), 0.0) if s.shape[-1] else s.new_zeros(ids.shape)
    at = reduce_from_tp(mine, group)
    s_tail = _tail(s, _off_mask(ids, held, cols, s.shape[-1]), group)
    return bucket_divergence(torch.cat([at, s_tail[:, None]], -1), torch.cat([logps, tail[:, None]], -1), beta)


def topk_divergence(student: torch.Tensor, teacher: TopK, labels: torch.Tensor, *, beta: float,
                    temperature: float = 1.0, group: Group = None, vocab_size: Optional[int] = None,
                    chunk: int = 1024) -> torch.Tensor:
    """The top-k divergence of every target token [batch, seq] (fp32, 0 where labels == -100) from
    this rank's slice of the student's logits [batch, seq, V/tp] and the teacher's TopK of the
    target tokens in row-major order ([n_targets, k]: what the store holds for these rows)."""
    s, start = _slice(student, group, vocab_size)
    flat = labels.reshape(-1)
    rows = (flat != IGNORE_INDEX).nonzero().squeeze(-1)
    if teacher.ids.shape[0] != rows.numel():
        raise ValueError(f"the teacher's top-k holds {teacher.ids.shape[0]} target tokens and the micro-batch "
                         f"{rows.numel()}")
    out = torch.zeros(flat.shape, dtype=torch.float32, device=student.device)
    parts = []
    for pos in torch.arange(rows.numel(), device=rows.device).split(max(1, chunk)):
        args = (s.index_select(0, rows[pos]), teacher.ids[pos], teacher.logps[pos].float(),
                teacher.tail[pos].float(), start, beta, temperature, group)
        parts.append(checkpoint(_chunk_divergence, *args, use_reentrant=False) if s.requires_grad
                     else _chunk_divergence(*args))
    if parts:
        out = out.index_put((rows,), torch.cat(parts))
    return out.view(labels.shape)
