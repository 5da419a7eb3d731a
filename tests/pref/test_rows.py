"""The preference rows gathered with numpy (megaft.pref.batches.PairRows) equal their
definition, `row_of` per pair (inputs and labels, ORPO's whole labels and target count), at
lengths that cut answers, drop prompts that fill the row and leave prompts empty."""
from __future__ import annotations

import random

import pytest
import torch

from megaft.data.batches import IGNORE_INDEX
from megaft.pref.batches import PairRows, row_of
from megaft.pref.data import Pair


def pairs(n: int, seed: int = 0) -> list[Pair]:
    rng = random.Random(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(3, 50) for _ in range(rng.randint(lo, hi))]

    return [Pair(ids(0, 9), ids(1, 9), ids(1, 9)) for _ in range(n)]


@pytest.mark.parametrize("seq_len", [4, 9, 24])
def test_rows_equal_row_of_every_pair(seq_len):
    table = pairs(40)
    rows = PairRows(table, seq_len, seed=3, pad_id=1)
    assert rows.dropped == sum(len(p.prompt_ids) >= seq_len for p in table)
    for step in range(3):
        ids = rows.pair_ids(step, 7)
        inputs, labels = rows.rows(ids)
        whole = rows.whole_rows(ids)
        want_in, want_lab, want_whole = [], [], []
        for k in ids.tolist():
            p = rows.pair(k)
            for answer in (p.chosen_ids, p.rejected_ids):
                i, lab = row_of(p.prompt_ids, answer, seq_len, 1)
                want_in.append(i)
                want_lab.append(lab)
            want_whole += [row_of(p.prompt_ids, p.chosen_ids, seq_len, 1, whole=True)[1], [IGNORE_INDEX] * seq_len]
        assert inputs.tolist() == want_in
        assert labels.tolist() == want_lab
        assert whole.tolist() == want_whole
        assert rows.whole_tokens(ids) == int((whole != IGNORE_INDEX).sum())
        assert rows.tokens(ids) == sum(t != 1 for r in want_in for t in r)  # pad 1: no token is 1


def test_pair_ids_run_through_the_epochs_in_order():
    rows = PairRows(pairs(10), 24, seed=5, pad_id=1)
    n = rows.epoch_size()
    flat = [int(i) for step in range(7) for i in rows.pair_ids(step, 3)]  # 21 pairs: 3 epochs
    want = [int(rows._order(i // n)[i % n]) for i in range(21)]
    assert flat == want
    assert sorted(flat[:n]) == list(range(n)) and sorted(flat[n:2 * n]) == list(range(n))
    assert isinstance(rows.pair_ids(0, 3), torch.Tensor)


def test_the_benchmarks_two_ways_agree():
    # benchmarks.pref_rows times the replaced per-token path against PairRows: the same rows first
    from benchmarks.pref_rows import make_pairs, per_token, vectorised

    rows = PairRows(make_pairs(30, 64), 64, seed=0, pad_id=0)
    ids = rows.pair_ids(1, 8)
    (a_in, a_lab, a_n), (b_in, b_lab, b_n) = per_token(rows, ids), vectorised(rows, ids)
    assert torch.equal(a_in, b_in) and torch.equal(a_lab, b_lab) and a_n == b_n > 0
