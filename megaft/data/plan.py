"""Packing plans: which document pieces go into which training sequence (pure functions).

An epoch's plan depends on the seed, the epoch number, the document lengths (and
the mixture) alone, so every rank computes the same one without communicating:

1. order: the epoch's documents (megaft.data.sources.mixture) in a permutation
   drawn from `numpy.random.default_rng([seed, epoch])`;
2. pieces: a document of at most seq_len tokens is one piece; a longer one is
   split into seq_len-token pieces (long_docs=split), cut to its first seq_len
   tokens (truncate) or left out (drop); empty documents are left out;
3. bins: packing=docs puts each piece, in order, into the first sequence with
   room for it (first-fit, O(pieces log pieces) with a max-segment tree over the
   sequences); packing=none gives every piece its own sequence.

The rest of a sequence is padding. Pieces keep their order inside a sequence.
"""

from __future__ import annotations

import array
from typing import NamedTuple

import numpy as np

from megaft.config.data import LongDocs

LONG_DOCS = tuple(d.value for d in LongDocs)  # plain strings: error messages list them as written


class EpochPlan(NamedTuple):
    """Sequence k of the epoch holds pieces ptr[k] .. ptr[k+1]-1; piece j is tokens
    start[j] .. start[j] + length[j] - 1 of document doc[j]."""

    ptr: np.ndarray  # int64 [sequences + 1]
    doc: np.ndarray  # int64 [pieces]
    start: np.ndarray  # int64 [pieces]
    length: np.ndarray  # int64 [pieces]

    @property
    def num_sequences(self) -> int:
        return len(self.ptr) - 1


def first_fit(lengths, capacity: int) -> np.ndarray:
    """Bin of each item for first-fit in the given order: the lowest-numbered bin whose
    free room is at least the item. Bins are numbered in the order they open. Each
    item must be in [1, capacity]."""
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size *= 2
    # tree[i] = the most free room among the bins under node i; leaves are bins. array.array
    # keeps it at 4 bytes an entry (a list of ints costs ~36) at ~25% more time.
    tree = array.array("i", [capacity]) * (2 * size)
    items = array.array("i")
    items.frombytes(np.ascontiguousarray(lengths, dtype=np.int32).tobytes())
    bins = np.empty(n, dtype=np.int64)
    for j, need in enumerate(items):
        i = 1
        while i < size:  # descend to the leftmost leaf with room
            i = 2 * i if tree[2 * i] >= need else 2 * i + 1
        bins[j] = i - size
        tree[i] -= need
        i >>= 1
        while i:  # repair the maxima on the way up; stop where nothing changed
            best = tree[2 * i] if tree[2 * i] >= tree[2 * i + 1] else tree[2 * i + 1]
            if tree[i] == best:
                break
            tree[i] = best
            i >>= 1
    return bins


def pieces(docs: np.ndarray, lengths: np.ndarray, seq_len: int, long_docs: str
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc, start, length) of the pieces of `docs` in order (step 2 of the module doc)."""
    lens = lengths[docs]
    keep = lens > 0
    if long_docs == "drop":
        keep &= lens <= seq_len
    docs, lens = docs[keep], lens[keep]
    if long_docs == "truncate":
        return docs, np.zeros_like(docs), np.minimum(lens, seq_len)
    count = -(-lens // seq_len)  # ceil: 1 for every document that fits
    doc = np.repeat(docs, count)
    first = np.cumsum(count) - count  # index of each document's first piece
    k = np.arange(len(doc)) - np.repeat(first, count)  # piece number within its document
    start = k * seq_len
    return doc, start, np.minimum(np.repeat(lens, count) - start, seq_len)


def epoch_plan(docs: np.ndarray, lengths: np.ndarray, seq_len: int, seed: int, epoch: int,
               packing: str = "docs", long_docs: str = "split") -> EpochPlan:
    """The plan of one epoch over the document indices `docs` (with repeats, from the
    mixture); `lengths[d]` is the token count of document d."""
    if packing not in ("docs", "none"):
        raise ValueError(f"epoch_plan packs 'docs' or 'none', got {packing!r}")
    if long_docs not in LONG_DOCS:
        raise ValueError(f"long_docs must be one of {LONG_DOCS}, got {long_docs!r}")
    order = np.asarray(docs, dtype=np.int64)[np.random.default_rng([seed, epoch]).permutation(len(docs))]
    doc, start, length = pieces(order, np.asarray(lengths, dtype=np.int64), seq_len, long_docs)
    if packing == "none":
        bins = np.arange(len(doc), dtype=np.int64)
    else:
        bins = first_fit(length, seq_len)
    # A stable sort keeps each bin's pieces in the order they were placed.
    by_bin = np.argsort(bins, kind="stable")
    ptr = np.zeros(int(bins.max(initial=-1)) + 2, dtype=np.int64)
    np.add.at(ptr, bins + 1, 1)
    return EpochPlan(np.cumsum(ptr), doc[by_bin], start[by_bin], length[by_bin])
