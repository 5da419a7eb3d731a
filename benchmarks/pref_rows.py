"""Building a preference step's rows: numpy over the pairs' offsets (megaft.pref.batches.PairRows,
issue 38) against the per-token Python it replaced (`row_of` for every row, and ORPO's whole
rows built again only to count their targets), on the same pairs, in one run.

    python -m benchmarks.pref_rows [--pairs N] [--batch G] [--seq L] [--rounds R]

The pairs are N random pairs (prompts and answers of random lengths up to --seq/2 tokens) held
in memory (the store's memory-mapped arrays read the same way); each round builds the rows of
one step of G pairs both ways, alternating which goes first, after checking they are equal.
Prints the median seconds of each and their ratio.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from megaft.data.batches import IGNORE_INDEX
from megaft.pref.batches import PairRows, row_of
from megaft.pref.data import Pair


def make_pairs(n: int, seq: int, seed: int = 0) -> list[Pair]:
    rng = random.Random(seed)

    def ids() -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(rng.randint(1, seq // 2 - 1))]

    return [Pair(ids(), ids(), ids()) for _ in range(n)]


def per_token(rows: PairRows, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The replaced path: row_of for every row, and ORPO's whole rows to count their targets."""
    made = [row_of(p.prompt_ids, c, rows.seq_len, rows.pad_id) for p in map(rows.pair, ids.tolist())
            for c in (p.chosen_ids, p.rejected_ids)]
    inputs = torch.tensor([r[0] for r in made], dtype=torch.long)
    labels = torch.tensor([r[1] for r in made], dtype=torch.long)
    whole = torch.full((2 * len(ids), rows.seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, p in enumerate(map(rows.pair, ids.tolist())):
        whole[2 * i] = torch.tensor(row_of(p.prompt_ids, p.chosen_ids, rows.seq_len, rows.pad_id, whole=True)[1])
    return inputs, labels, int((whole != IGNORE_INDEX).sum())


def vectorised(rows: PairRows, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    inputs, labels = rows.rows(ids)
    return inputs, labels, rows.whole_tokens(ids)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64, help="pairs per step")
    p.add_argument("--seq", type=int, default=2048, help="data.seq_len")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    rows = PairRows(make_pairs(args.pairs, args.seq), args.seq, seed=0, pad_id=0)
    ways = {"per_token": per_token, "numpy": vectorised}
    times = {name: [] for name in ways}
    for r in range(args.rounds):
        ids = rows.pair_ids(r, args.batch)
        got = {}
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            start = time.perf_counter()
            got[name] = ways[name](rows, ids)
            times[name].append(time.perf_counter() - start)
        a, b = got["per_token"], got["numpy"]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2], "the two ways differ"
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"rows of one step: {args.batch} pairs of data.seq_len {args.seq}, median of {args.rounds} rounds")
    for name, t in med.items():
        print(f"  {name:>9}: {t * 1e3:8.2f} ms")
    print(f"  numpy / per_token: {med['numpy'] / med['per_token']:.3f}")


if __name__ == "__main__":
    main()
