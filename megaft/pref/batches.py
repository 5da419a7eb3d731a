"""Preference pairs as training rows: each pair two rows of `seq_len` tokens, chosen then
rejected, in an epoch-shuffled order that is a pure function of (seed, step).

Row layout (megaft.data.batches' convention): the inputs are prompt + completion padded
with `pad_id`; `labels[t]` is the token t must predict where that token is a completion
token, -100 elsewhere (the prompt, the padding, the last position). ORPO's SFT term reads
every token of the chosen row after the first (TRL labels prompt and answer there):
`whole_labels` marks those.

A global batch of G pairs is 2G rows in pair order [c0, r0, c1, r1, ...], so a dp share
or micro-batch of an even number of rows holds whole pairs; `chosen_rows` / `rejected_rows`
pick them back out.
"""
from __future__ import annotations

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
    """Pairs held in memory (data.eval_path's) with megaft.pref.store.StoredPairs' view: one source."""

    def __init__(self, pairs: list[Pair]):
        self.pairs = pairs
        self.lengths = np.array([[len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)] for p in pairs],
                                dtype=np.int64).reshape(-1, 3)
        self.source = np.zeros(len(pairs), dtype=np.int32)

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
        self._epoch_size: Optional[int] = None

    def __len__(self) -> int:
        return len(self.kept)

    def pair(self, k: int) -> Pair:
        """Kept pair k, cut to seq_len."""
        p = self.table[int(self.kept[int(k)])]
        room = self.seq_len - len(p.prompt_ids)
        return Pair(p.prompt_ids, p.chosen_ids[:room], p.rejected_ids[:room])

    def _order(self, epoch: int) -> np.ndarray:
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
        ids = [int(self._order(i // n)[i % n]) for i in range(step * size, (step + 1) * size)]
        return torch.tensor(ids, dtype=torch.long)

    def rows(self, pair_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of these pairs, [2 * len(pair_ids), seq_len] in pair order."""
        rows = [row_of(p.prompt_ids, c, self.seq_len, self.pad_id)
                for p in map(self.pair, pair_ids.tolist()) for c in (p.chosen_ids, p.rejected_ids)]
        return (torch.tensor([r[0] for r in rows], dtype=torch.long).reshape(-1, self.seq_len),
                torch.tensor([r[1] for r in rows], dtype=torch.long).reshape(-1, self.seq_len))

    def tokens(self, pair_ids: torch.Tensor) -> int:
        """The real (unpadded) tokens of these pairs' rows."""
        return int(self.lengths[self._index(pair_ids)].sum())

    @staticmethod
    def _index(pair_ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([2 * pair_ids, 2 * pair_ids + 1], dim=1).reshape(-1)

    def whole_rows(self, pair_ids: torch.Tensor) -> torch.Tensor:
        """ORPO's labels of these pairs' rows, as `rows` lays them out: every next token of
        the chosen rows, nothing of the rejected ones."""
        out = torch.full((2 * len(pair_ids), self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for i, p in enumerate(map(self.pair, pair_ids.tolist())):
            out[2 * i] = torch.tensor(row_of(p.prompt_ids, p.chosen_ids, self.seq_len, self.pad_id, whole=True)[1])
        return out
