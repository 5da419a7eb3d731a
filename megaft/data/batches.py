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
    input = window[:-1], labels = window[1:] (-100 where the token is not a
    target). Windows overlap by one token, as in Megatron's GPTDataset, so the
    inputs of consecutive sequences concatenate to the stream itself and every
    target token is predicted exactly once per epoch, apart from the very first
    token of the stream. Windows run across example and epoch boundaries.
    """

    def __init__(self, encoded: list[Encoded], seq_len: int, seed: int, cache_epochs: int = 2):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len, self.seed, self.cache_epochs = seq_len, seed, cache_epochs
        self._ids = [np.asarray(e.ids, dtype=np.int64) for e in encoded]
        self._target = [np.asarray(e.target, dtype=bool) for e in encoded]
        self.tokens_per_epoch = sum(len(a) for a in self._ids)
        if self.tokens_per_epoch == 0:
            raise ValueError("PackedStream needs at least one token; the examples are all empty")
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, target) of one epoch, packed once and kept in a small LRU cache:
        steps advance monotonically, so only the current and next epoch are hot."""
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self._ids))
        packed = (np.concatenate([self._ids[i] for i in order]),
                  np.concatenate([self._target[i] for i in order]))
        self._epochs[epoch] = packed
        while len(self._epochs) > self.cache_epochs:
            self._epochs.popitem(last=False)
        return packed

    def tokens(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, target) of stream positions [start, stop)."""
        ids, target = [], []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.tokens_per_epoch)
            e_ids, e_target = self._epoch(epoch)
            end = min(self.tokens_per_epoch, offset + stop - pos)
            ids.append(e_ids[offset:end])
            target.append(e_target[offset:end])
            pos += end - offset
        return np.concatenate(ids), np.concatenate(target)

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences step*size ... (step+1)*size - 1 as (input_ids, labels),
        both LongTensor[size, seq_len].

        A pure function of (encoded, seq_len, seed, step, size): every rank of
        every parallel layout gets the same global batch and slices its data-
        parallel share and micro-batches out of it.
        """
        n = self.seq_len
        start = step * size * n
        ids, target = self.tokens(start, start + size * n + 1)
        labels = np.where(target[1:], ids[1:], IGNORE_INDEX)
        return (torch.from_numpy(ids[:-1].reshape(size, n)),
                torch.from_numpy(labels.reshape(size, n)))

    def epoch_at(self, step: int, size: int) -> float:
        """How many epochs the first `step` global batches consumed (for logging)."""
        return step * size * self.seq_len / self.tokens_per_epoch


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
