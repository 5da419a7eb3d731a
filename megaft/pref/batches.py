"""Preference pairs as training rows: each pair two rows of `seq_len` tokens, chosen then
rejected, in an epoch-shuffled order that is a pure function of (seed, step).

Row layout (megaft.data.batches' convention): the inputs are prompt + completion padded
with `pad_id`; `labels[t]` is the token t must predict where that token is a completion
token, -100 elsewhere (the prompt, the padding, the last position). ORPO's SFT term reads
every token of the chosen row after the first (TRL labels prompt and answer there):
`whole_labels` marks those.

A global batch of G pairs is 2G rows in pair order [c0, r0, c1, r1, ...], so a dp share
or micro-batch of an even number of rows holds whole pairs; `chosen_rows` / `rejected_rows`
pick them back out. Rows are gathered with numpy from the table's token array and offsets
(no Python loop over tokens); `row_of` is the definition they equal (tests/pref/test_data.py).
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np
import torch

from megaft.data.batches import IGNORE_INDEX
from megaft.data.sources import mixture
from megaft.pref.data import Pair


def row_of(prompt: list[int], completion: list[int], seq_len: int, pad_id: int,
           whole: bool = False) -> tuple[list[int], list[int]]:
    """(input ids, labels) of prompt + completion padded to `seq_len`; `whole`: every next
    token is a target (ORPO's SFT term), else only the completion's."""
    ids = prompt + completion
    if len(ids) > seq_len:
        raise ValueError(f"a pair row of {len(ids)} tokens does not fit seq_len={seq_len} (truncate first)")
    first = 1 if whole else len(prompt)  # the first position whose token is a target
    labels = [IGNORE_INDEX] * seq_len
    for t in range(max(first, 1), len(ids)):
        labels[t - 1] = ids[t]
    return ids + [pad_id] * (seq_len - len(ids)), labels


def chosen_rows(x: torch.Tensor) -> torch.Tensor:
    return x[0::2]


def rejected_rows(x: torch.Tensor) -> torch.Tensor:
    return x[1::2]


class PairList:
    """Pairs held in memory (data.eval_path's) with megaft.pref.store.StoredPairs' view: one source,
    the tokens of pair i at tokens[offsets[3i]:offsets[3i+3]] (prompt, chosen, rejected)."""

    def __init__(self, pairs: list[Pair]):
        self.pairs = pairs
        self.lengths = np.array([[len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)] for p in pairs],
                                dtype=np.int64).reshape(-1, 3)
        self.source = np.zeros(len(pairs), dtype=np.int32)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths.reshape(-1))])
        parts = [part for p in pairs for part in (p.prompt_ids, p.chosen_ids, p.rejected_ids)]
        self.tokens = np.array([t for part in parts for t in part], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> Pair:
        return self.pairs[i]


class PairRows:
    """The pairs of a run as rows, and the order they are trained in.

    `table` holds the pairs (megaft.pref.store's StoredPairs or PairList: `table[i]` a Pair,
    `lengths` [pairs, 3], `source` [pairs]); each is cut to `seq_len` as TRL's max_length cuts
    it, and one whose prompt alone fills seq_len is dropped (`dropped` counts them; `drop_long`:
    a pair with a row longer than seq_len is dropped whole, as TRL's RewardTrainer). Rows are
    made on demand, so a store of any size costs memory only for its lengths.

    Epoch e visits the pairs of megaft.data.sources.mixture(source, `weights`, seed, e) (every
    pair once for one source of weight 1) in `numpy.random.default_rng([seed, e]).permutation`
    order; step s's global batch is pairs s*G .. (s+1)*G - 1 of the endless sequence of epochs."""

    def __init__(self, table, seq_len: int, seed: int, pad_id: int, weights: Optional[list[float]] = None,
                 drop_long: bool = False):
        table = PairList(table) if isinstance(table, list) else table
        self.seq_len, self.seed, self.pad_id, self.table = seq_len, seed, pad_id, table
        lengths = np.asarray(table.lengths, dtype=np.int64).reshape(-1, 3)
        if drop_long:  # TRL's RewardTrainer drops a pair either of whose rows exceeds max_length
            self.kept = np.flatnonzero(lengths[:, 0] + lengths[:, 1:].max(1) <= seq_len)
        else:
            self.kept = np.flatnonzero(lengths[:, 0] < seq_len)  # TRL drops a pair whose prompt fills max_length
        self.dropped = len(lengths) - len(self.kept)
        if not len(self.kept):
            what = "a row of each pair is longer" if drop_long else "each prompt is as long or longer"
            raise ValueError(f"no preference pair fits data.seq_len ({what}); "
                             "fix: raise data.seq_len")
        kept = lengths[self.kept]
        room = seq_len - kept[:, :1]
        self.lengths = torch.from_numpy((kept[:, :1] + np.minimum(kept[:, 1:], room)).reshape(-1))  # [2 * pairs]
        self.source = np.asarray(table.source)[self.kept]
        self.weights = weights
        self._orders: dict[int, np.ndarray] = {}
        self._orders_lock = threading.Lock()  # megaft.data.ahead makes the next batch on a thread
        self._epoch_size: Optional[int] = None

    def __len__(self) -> int:
        return len(self.kept)

    def pair(self, k: int) -> Pair:
        """Kept pair k, cut to seq_len."""
        p = self.table[int(self.kept[int(k)])]
        room = self.seq_len - len(p.prompt_ids)
        return Pair(p.prompt_ids, p.chosen_ids[:room], p.rejected_ids[:room])

    def _order(self, epoch: int) -> np.ndarray:
        with self._orders_lock:
            return self._order_locked(epoch)

    def _order_locked(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:  # steps advance monotonically: two epochs are hot
                self._orders.pop(min(self._orders))
            mix = np.arange(len(self)) if self.weights is None else mixture(self.source, self.weights, self.seed,
                                                                              epoch)
            self._orders[epoch] = mix[np.random.default_rng([self.seed, epoch]).permutation(len(mix))]
        return self._orders[epoch]

    def epoch_size(self) -> int:
        """Pairs an epoch visits (the same every epoch: the mixture draws a fixed count per source)."""
        if self._epoch_size is None:
            self._epoch_size = len(self._order(0))
        return self._epoch_size

    def pair_ids(self, step: int, size: int) -> torch.Tensor:
        """The indices of step `step`'s `size` pairs."""
        n = self.epoch_size()
        if n == 0:
            raise ValueError("the data.sources weights draw no pair in an epoch; fix: raise a source's weight")
        i = np.arange(step * size, (step + 1) * size)
        ids = np.empty(size, dtype=np.int64)
        for epoch in np.unique(i // n):
            at = i // n == epoch
            ids[at] = self._order(int(epoch))[i[at] % n]
        return torch.from_numpy(ids)

    def _spans(self, pair_ids: torch.Tensor) -> tuple[np.ndarray, ...]:
        """Per row of these pairs (pair order, chosen then rejected): where its prompt and its
        answer start in the table's tokens, and their lengths (the answer cut to seq_len)."""
        k = self.kept[pair_ids.numpy()]
        offsets = self.table.offsets
        a, b, c, d = (np.asarray(offsets[3 * k + j], dtype=np.int64) for j in range(4))
        room = np.repeat(self.seq_len - (b - a), 2)
        answer_len = np.minimum(np.stack([c - b, d - c], 1).reshape(-1), room)
        return np.repeat(a, 2), np.repeat(b - a, 2), np.stack([b, c], 1).reshape(-1), answer_len

    def rows(self, pair_ids: torch.Tensor, whole: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of these pairs, [2 * len(pair_ids), seq_len] in pair order, each row
        `row_of` its prompt and answer; `whole`: ORPO's labels (every next token, chosen rows only)."""
        prompt_at, prompt_len, answer_at, answer_len = self._spans(pair_ids)
        t = np.arange(self.seq_len)
        length = (prompt_len + answer_len)[:, None]
        at = np.where(t < prompt_len[:, None], prompt_at[:, None] + t, answer_at[:, None] + t - prompt_len[:, None])
        real = t < length
        inputs = np.where(real, np.asarray(self.table.tokens)[np.where(real, at, 0)], self.pad_id).astype(np.int64)
        first = np.ones_like(prompt_len) if whole else np.maximum(prompt_len, 1)  # row_of's first target
        target = (t[1:] >= first[:, None]) & (t[1:] < length)
        if whole:
            target[1::2] = False
        labels = np.full_like(inputs, IGNORE_INDEX)
        labels[:, :-1] = np.where(target, inputs[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(inputs), torch.from_numpy(labels)

    def tokens(self, pair_ids: torch.Tensor) -> int:
        """The real (unpadded) tokens of these pairs' rows."""
        return int(self.lengths[self._index(pair_ids)].sum())

    def whole_tokens(self, pair_ids: torch.Tensor) -> int:
        """ORPO's targets of these pairs: every token after the first of each chosen row."""
        return int((chosen_rows(self.lengths[self._index(pair_ids)]) - 1).clamp(min=0).sum())

    @staticmethod
    def _index(pair_ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([2 * pair_ids, 2 * pair_ids + 1], dim=1).reshape(-1)

    def whole_rows(self, pair_ids: torch.Tensor) -> torch.Tensor:
        """ORPO's labels of these pairs' rows, as `rows` lays them out: every next token of
        the chosen rows, nothing of the rejected ones."""
        return self.rows(pair_ids, whole=True)[1]
