"""Batches: packed training sequences and padded eval sequences.

Both use one convention: `labels[b, j]` is the token position j must predict,
already shifted (`labels[b, j] == input_ids[b, j + 1]` where both are real), and
-100 (torch cross-entropy's ignore_index) where nothing is to be predicted. The
model computes `cross_entropy(logits.flatten(0, 1), labels.flatten())` with no
shifting of its own.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from fractions import Fraction
from typing import Optional

import numpy as np
import torch

from megaft.data.encode import Encoded

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def count_targets(labels: torch.Tensor) -> int:
    """Number of positions that carry a loss (labels != -100)."""
    return int((labels != IGNORE_INDEX).sum())


class PackedStream:
    """Training sequences packed from an infinite, epoch-shuffled token stream.

    Epoch e lists every example once, in the order of a permutation drawn from
    `numpy.random.default_rng([seed, e])`, and concatenates their ids and target
    masks; the stream is epoch 0, then epoch 1, ... with no gap. Sequence k is
    the window of seq_len + 1 tokens starting at stream position k * seq_len:
    input = window[:-1], labels = window[1:]. Windows overlap by one token, as in
    Megatron's GPTDataset, so the inputs of consecutive sequences concatenate to
    the stream itself, and run across example and epoch boundaries.

    A label is -100 where its token is not a target, and also where its example
    has a prompt (`Encoded.prompt_len > 0`) that starts before the window: a
    completion whose question was cut off cannot be predicted, and training on
    it would teach the model to answer questions it never saw. Text examples
    are never cut this way, as in pretraining.
    """

    def __init__(self, encoded: list[Encoded], seq_len: int, seed: int, cache_epochs: int = 2):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len, self.seed, self.cache_epochs = seq_len, seed, cache_epochs
        self._ids = [np.asarray(e.ids, dtype=np.int64) for e in encoded]
        self._target = [np.asarray(e.target, dtype=bool) for e in encoded]
        self._has_prompt = np.array([e.prompt_len > 0 for e in encoded], dtype=bool)
        self._lens = np.array([len(e.ids) for e in encoded], dtype=np.int64)
        self.tokens_per_epoch = int(self._lens.sum())
        if self.tokens_per_epoch == 0:
            raise ValueError("PackedStream needs at least one token; the examples are all empty")
        # A prompted example's targets count only in a window holding its start, so
        # tokens past seq_len + 1 of it are never trained: say so once, up front.
        too_long = int((self._has_prompt & (self._lens > seq_len + 1)).sum())
        if too_long:
            warnings.warn(f"{too_long} of {len(encoded)} prompt/completion examples are longer "
                          f"than seq_len + 1 = {seq_len + 1} tokens; their tokens past that are "
                          "never trained; fix: raise data.seq_len")
        self._epochs: OrderedDict[int, tuple[np.ndarray, ...]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, target, start) of one epoch, packed once and kept in a small LRU
        cache (steps advance monotonically, so only two epochs are hot). start[i]
        is the in-epoch offset of the first token of token i's example when that
        example has a prompt, else -1."""
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self._ids))
        lens = self._lens[order]
        offsets = np.cumsum(lens) - lens
        start = np.repeat(np.where(self._has_prompt[order], offsets, -1), lens)
        packed = (np.concatenate([self._ids[i] for i in order]),
                  np.concatenate([self._target[i] for i in order]), start)
        self._epochs[epoch] = packed
        while len(self._epochs) > self.cache_epochs:
            self._epochs.popitem(last=False)
        return packed

    def tokens(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, target, start) of stream positions [begin, end); start holds the
        stream position where a prompted token's example begins, else -1."""
        parts = []
        pos = begin
        while pos < end:
            epoch, offset = divmod(pos, self.tokens_per_epoch)
            arrays = self._epoch(epoch)
            stop = min(self.tokens_per_epoch, offset + end - pos)
            ids, target, start = (a[offset:stop] for a in arrays)
            start = np.where(start >= 0, start + epoch * self.tokens_per_epoch, -1)
            parts.append((ids, target, start))
            pos += stop - offset
        return tuple(np.concatenate(p) for p in zip(*parts))

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences step*size ... (step+1)*size - 1 as (input_ids, labels),
        both LongTensor[size, seq_len].

        A pure function of (encoded, seq_len, seed, step, size): every rank of
        every parallel layout gets the same global batch and slices its data-
        parallel share and micro-batches out of it.
        """
        n = self.seq_len
        first = step * size * n
        ids, target, start = self.tokens(first, first + size * n + 1)
        window = first + n * np.arange(size, dtype=np.int64)[:, None]  # where each row begins
        start = start[1:].reshape(size, n)
        keep = target[1:].reshape(size, n) & ~((start >= 0) & (start < window))
        labels = np.where(keep, ids[1:].reshape(size, n), IGNORE_INDEX)
        return torch.from_numpy(ids[:-1].reshape(size, n)), torch.from_numpy(labels)

    def epoch_at(self, step: int, size: int) -> float:
        """How many epochs the first `step` global batches consumed (for logging)."""
        return step * size * self.seq_len / self.tokens_per_epoch

    def sequences_in(self, epochs: Fraction) -> Fraction:
        """The sequences the first `epochs` epochs fill (sequence k starts at stream token k * seq_len)."""
        return epochs * self.tokens_per_epoch / self.seq_len


def eval_batches(encoded: list[Encoded], batch_size: int, pad_id: int,
                 max_len: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Eval batches: one example per row, unpacked, in file order.

    Row i holds input = ids[:-1] and labels = ids[1:] (-100 where not a target),
    right-padded with `pad_id` (labels -100) to the longest row of its batch.
    `max_len` caps the input length (the model's context): longer examples lose
    tokens from the right, with one warning counting them. Returns a list so the
    caller can reuse it at every eval; sum `count_targets(labels)` over it for
    the token count of a token-weighted mean loss.
    """
    rows, truncated = [], 0
    for e in encoded:
        ids, target = e.ids, e.target
        if max_len is not None and len(ids) > max_len + 1:
            ids, target, truncated = ids[:max_len + 1], target[:max_len + 1], truncated + 1
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], target[1:])]
        rows.append((ids[:-1], labels))
    if truncated:
        warnings.warn(f"eval: {truncated} of {len(encoded)} examples are longer than "
                      f"max_len={max_len} tokens and were truncated from the right")
    batches = []
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        width = max(1, max(len(x) for x, _ in chunk))  # a 1-token example still gets a column
        inputs = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        for r, (x, y) in enumerate(chunk):
            inputs[r, :len(x)] = torch.tensor(x, dtype=torch.long)
            labels[r, :len(y)] = torch.tensor(y, dtype=torch.long)
        batches.append((inputs, labels))
    return batches
