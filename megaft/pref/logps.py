"""Per-sequence log-probabilities of completion tokens, from megaft's vocab-parallel
cross-entropy: the quantities every preference objective (megaft.pref.losses) reads.

log p(y_t | y_<t) is minus the per-token cross-entropy that the SFT loss already computes
(megaft.kernels.cross_entropy: Megatron's vocab-parallel scheme, three per-token
all-reduces over tp), so this never gathers the vocabulary nor builds a full softmax of
gathered logits: it works on each tp rank's slice of the logits as Decoder.loss_sum does,
and with `kernels.fused_linear_cross_entropy` without the logits of the whole batch.

Labels follow megaft's convention: `labels[:, t]` is the target of position t (already
shifted; -100 = not a target). TRL's batches hold unshifted ids and a completion mask;
`next_token_labels` turns them into megaft's labels.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from megaft.kernels.cross_entropy import cross_entropy, linear_cross_entropy
from megaft.kernels.cross_entropy.reference import IGNORE_INDEX
from megaft.layers.linear import column_input
from megaft.models.attention.documents import Docs
from megaft.models.attention.gqa import op_backend
from megaft.models.decoder import Decoder
from megaft.parallel.comm import Group, all_reduce, group_rank


class SequenceLogps(NamedTuple):
    """Summed log-probabilities of each row's target tokens [rows] (fp32) and their
    number [rows]. Objectives that average (IPO, SimPO, ORPO) divide the two, so the
    mean is exact however the tokens were split."""
    sum: torch.Tensor
    count: torch.Tensor

    def mean(self) -> torch.Tensor:
        """Per-token average; a row without targets counts as one token (TRL's IPO clamp)."""
        return self.sum / self.count.clamp(min=1)

    def split(self, n: int) -> tuple["SequenceLogps", "SequenceLogps"]:
        """(first n rows, the rest): TRL's concatenated batches put the chosen rows first."""
        return SequenceLogps(self.sum[:n], self.count[:n]), SequenceLogps(self.sum[n:], self.count[n:])


def next_token_labels(input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """megaft labels [batch, seq] of `input_ids`: position t targets token t + 1 where
    `mask[:, t + 1]` is set (a completion token), -100 elsewhere and at the last position."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(~mask[:, 1:].bool(), IGNORE_INDEX)
    return labels


def token_logps(logits: torch.Tensor, labels: torch.Tensor, *, group: Group = None,
                vocab_size: Optional[int] = None, backend: str = "torch") -> torch.Tensor:
    """log p(label) at every position [batch, seq] (fp32, 0 where labels == -100) from this
    tp rank's vocabulary slice of `logits` [batch, seq, V/tp]; `vocab_size` is the true
    vocabulary (padded columns are never predicted)."""
    local = logits.shape[-1]
    losses = cross_entropy(logits.reshape(-1, local), labels.reshape(-1), group=group,
                           vocab_start=group_rank(group) * local, vocab_size=vocab_size, backend=backend)
    return -losses.view(labels.shape)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, *, group: Group, vocab_size: int) -> torch.Tensor:
    """The entropy of softmax(logits) over the true vocabulary at every position [batch, seq]
    (fp32, no grad), from this tp rank's slice [batch, seq, V/tp]: log Z - sum p z with the max
    and the two sums all-reduced over tp (the vocabulary-parallel cross-entropy's reductions;
    the padding columns are no token)."""
    local = logits.shape[-1]
    z = logits.float()
    if (group_rank(group) + 1) * local > vocab_size:
        columns = torch.arange(group_rank(group) * local, (group_rank(group) + 1) * local, device=z.device)
        z = z.masked_fill(columns >= vocab_size, float("-inf"))
    top = z.amax(-1)
    all_reduce(top, group, torch.distributed.ReduceOp.MAX)
    e = torch.exp(z - top.unsqueeze(-1))
    sums = torch.stack([e.sum(-1), torch.where(e > 0, e * z, torch.zeros_like(z)).sum(-1)])
    all_reduce(sums, group)
    return torch.log(sums[0]) + top - sums[1] / sums[0]


def decoder_token_logps(model: Decoder, input_ids: torch.Tensor, labels: torch.Tensor,
                        docs: Optional[Docs] = None, router_valid: Optional[torch.Tensor] = None,
                        temperature: float = 1.0, entropy: bool = False):
    """`token_logps` of a whole Decoder (embedding to head) on `input_ids`: the per-token
    terms of Decoder.loss_sum, negated and not summed, through the same kernels (the fused
    linear cross-entropy when the model's KernelsConfig asks for it). `router_valid`: the
    positions a mixture of experts' router statistics count (Decoder.blocks). `temperature`:
    the log-probs of logits / temperature (GRPO's, as TRL's; the fused head takes h / temperature,
    the same logits). `entropy`: also each position's entropy (token_entropy, no grad; under the
    fused head from the logits recomputed a chunk of tokens at a time): (logps, entropies)."""
    kernels, vocab = model.kernels, model.cfg.vocab_size
    backend = op_backend(kernels, "cross_entropy")
    if kernels is not None and kernels.fused_linear_cross_entropy:
        head = model.lm_head
        if head.bias is not None:
            raise ValueError("the fused linear cross-entropy supports a head without bias only")
        # as megaft.models.decoder.fused_head_loss_sum, per token: the final norm, gathered as the head would
        h = column_input(model.norm(model.blocks(input_ids, docs, router_valid=router_valid)), head.group,
                         head.sequence_parallel)
        h = h[:, :labels.shape[1]]
        if temperature != 1.0:
            h = h / temperature
        flat = h.reshape(-1, h.shape[-1])
        losses = linear_cross_entropy(flat, head.weight, labels.reshape(-1), group=head.group,
                                      vocab_start=group_rank(head.group) * head.weight.shape[0], vocab_size=vocab,
                                      backend=backend, chunk=kernels.ce_chunk_tokens)
        if not entropy:
            return -losses.view(labels.shape)
        with torch.no_grad():
            parts = [token_entropy(torch.nn.functional.linear(c, head.weight), group=head.group, vocab_size=vocab)
                     for c in flat.detach().split(max(1, kernels.ce_chunk_tokens))]
        return -losses.view(labels.shape), torch.cat(parts).view(labels.shape)
    logits = model(input_ids, docs, router_valid=router_valid)[:, :labels.shape[1]]
    if temperature != 1.0:
        logits = logits / temperature
    logps = token_logps(logits, labels, group=model.group, vocab_size=vocab, backend=backend)
    if not entropy:
        return logps
    return logps, token_entropy(logits.detach(), group=model.group, vocab_size=vocab)


def sequence_logps(logps: torch.Tensor, labels: torch.Tensor) -> SequenceLogps:
    """Sum per row of the per-token log-probs [batch, seq] over the targets of `labels`."""
    targets = labels != IGNORE_INDEX
    return SequenceLogps(logps.masked_fill(~targets, 0.0).sum(-1), targets.sum(-1))
