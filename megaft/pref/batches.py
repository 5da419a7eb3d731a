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

import numpy as np
import torch

from megaft.data.batches import IGNORE_INDEX
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


class PairRows:
    """The pairs of a run as rows, and the order they are trained in: epoch e visits every
    pair once, in `numpy.random.default_rng([seed, e]).permutation`; step s's global batch
    is pairs s*G .. (s+1)*G - 1 of the endless sequence of epochs."""

    def __init__(self, pairs: list[Pair], seq_len: int, seed: int, pad_id: int):
        if not pairs:
            raise ValueError("no preference pair fits data.seq_len (each prompt is as long or longer); "
                             "fix: raise data.seq_len")
        self.seq_len, self.seed, self.pad_id = seq_len, seed, pad_id
        self.pairs = pairs
        rows = [row_of(p.prompt_ids, c, seq_len, pad_id) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
        self.lengths = torch.tensor([len(p.prompt_ids) + len(c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)])
        self.inputs = torch.tensor([r[0] for r in rows], dtype=torch.long)  # [2 * pairs, seq_len], pair order
        self.labels = torch.tensor([r[1] for r in rows], dtype=torch.long)
        self.whole_labels = torch.tensor([row_of(p.prompt_ids, p.chosen_ids, seq_len, pad_id, whole=True)[1]
                                          for p in pairs], dtype=torch.long)  # [pairs, seq_len], chosen rows
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.pairs)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:  # steps advance monotonically: two epochs are hot
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs))
        return self._orders[epoch]

    def pair_ids(self, step: int, size: int) -> torch.Tensor:
        """The indices of step `step`'s `size` pairs."""
        n = len(self.pairs)
        ids = [int(self._order(i // n)[i % n]) for i in range(step * size, (step + 1) * size)]
        return torch.tensor(ids, dtype=torch.long)

    def rows(self, pair_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of these pairs, [2 * len(pair_ids), seq_len] in pair order."""
        index = self._index(pair_ids)
        return self.inputs[index], self.labels[index]

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
        out[0::2] = self.whole_labels[pair_ids]
        return out
