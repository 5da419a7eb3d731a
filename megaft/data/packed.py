"""PackedDocs: training sequences that keep documents apart (data.packing=docs|none).

The analogue of PackedStream for supervised fine-tuning: `global_batch(step, n)`
returns (input_ids, labels) of the same shapes and convention (labels already
shifted, -100 where nothing is predicted), and `doc_batch(step, n)` adds what the
model needs to keep documents apart: position ids that restart at 0 in every
document, the document index of every position in its row, and flash-attn style
cu_seqlens. Sequences follow each other through epochs; epoch e is planned by
megaft.data.plan.epoch_plan, so the batch of a step is a pure function of (corpus,
seq_len, seed, weights, step, n).

Inside a piece the label of position j is the document's next token when that
token is a target. The last position of a piece has a label only when the
document goes on (a split or truncated document: its next token is known), never
across documents. Padding: input pad_id, label -100, positions 0, 1, ... and a
document index of its own, so the segments of a row cover it exactly.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from fractions import Fraction
from typing import NamedTuple, Optional, Protocol, Sequence

import numpy as np
import torch

from megaft.data.batches import IGNORE_INDEX
from megaft.data.encode import Encoded
from megaft.data.plan import LONG_DOCS, EpochPlan, epoch_plan
from megaft.data.sources import mixture
from megaft.models.attention.documents import Docs, segments
from megaft.models.attention.documents import document_mask as model_mask


class Corpus(Protocol):
    """Tokenized documents: an in-memory EncodedCorpus or a memory-mapped PreparedDataset."""

    lengths: np.ndarray  # int64 [documents]
    source: np.ndarray  # int [documents]: which data.sources entry each document came from

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, target) of document i."""


class EncodedCorpus:
    """A Corpus over a list of Encoded examples (all from source 0)."""

    def __init__(self, encoded: Sequence[Encoded]):
        self._ids = [np.asarray(e.ids, dtype=np.int64) for e in encoded]
        self._target = [np.asarray(e.target, dtype=bool) for e in encoded]
        self.lengths = np.array([len(e.ids) for e in encoded], dtype=np.int64)
        self.source = np.zeros(len(encoded), dtype=np.int64)

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self._ids[i], self._target[i]


class DocBatch(NamedTuple):
    """One global batch of packed documents; every tensor is LongTensor[n, seq_len]
    except cu_seqlens (int32 [segments + 1], offsets into the flattened batch)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor  # 0, 1, ... within each document (and within the padding)
    doc_ids: torch.Tensor  # segment index within the row: 0, 0, 1, 1, 1, 2 (padding last)
    cu_seqlens: torch.Tensor  # segment boundaries over input_ids.flatten(), for varlen kernels


class PackedDocs:
    """Sequences of whole documents (packing=docs: first-fit; none: one per row).

    `weights[s]` is data.sources[s].weight (megaft.data.sources.mixture); None = each
    document once per epoch. Documents longer than seq_len are handled by long_docs
    (split|truncate|drop); how many there are is warned about once, here.
    """

    def __init__(self, corpus: Corpus, seq_len: int, seed: int, *, pad_id: int = 0, packing: str = "docs",
                 long_docs: str = "split", weights: Optional[list[float]] = None, cache_epochs: int = 2):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if long_docs not in LONG_DOCS:
            raise ValueError(f"long_docs must be one of {LONG_DOCS}, got {long_docs!r}")
        self.corpus, self.seq_len, self.seed, self.pad_id = corpus, seq_len, seed, pad_id
        self.packing, self.long_docs, self.cache_epochs = packing, long_docs, cache_epochs
        self.lengths = np.asarray(corpus.lengths, dtype=np.int64)
        n_sources = int(corpus.source.max(initial=-1)) + 1
        self.weights = [1.0] * n_sources if weights is None else list(weights)
        if len(self.weights) < n_sources:
            raise ValueError(f"{n_sources} sources but {len(self.weights)} weights")
        self.long_doc_count = int((self.lengths > seq_len).sum())
        if self.long_doc_count:
            warnings.warn(f"{self.long_doc_count} of {len(self.lengths)} documents are longer than "
                          f"seq_len={seq_len} tokens and are {long_docs}"
                          f"{'ped' if long_docs == 'drop' else '' if long_docs == 'split' else 'd'} "
                          "(data.long_docs=split|truncate|drop)")
        self._plans: OrderedDict[int, EpochPlan] = OrderedDict()
        self._epoch_starts = [0]  # first global sequence index of epoch e (computed lazily)
        if self._plan(0).num_sequences == 0:
            raise ValueError("PackedDocs has no sequences: every document is empty or was dropped")

    def _plan(self, epoch: int) -> EpochPlan:
        """Epoch `epoch`'s plan, kept in a small LRU cache (steps advance monotonically)."""
        if epoch in self._plans:
            self._plans.move_to_end(epoch)
            return self._plans[epoch]
        docs = mixture(self.corpus.source, self.weights, self.seed, epoch)
        plan = epoch_plan(docs, self.lengths, self.seq_len, self.seed, epoch, self.packing, self.long_docs)
        self._plans[epoch] = plan
        while len(self._plans) > self.cache_epochs:
            self._plans.popitem(last=False)
        return plan

    def _grow_starts(self) -> None:
        """Append the first global sequence of the next epoch to _epoch_starts."""
        e = len(self._epoch_starts) - 1
        self._epoch_starts.append(self._epoch_starts[-1] + self._plan(e).num_sequences)

    def _locate(self, seq: int) -> tuple[int, int]:
        """(epoch, index in the epoch) of global sequence `seq`."""
        while self._epoch_starts[-1] <= seq:
            self._grow_starts()
        e = int(np.searchsorted(self._epoch_starts, seq, side="right")) - 1
        return e, seq - self._epoch_starts[e]

    def sequences_per_epoch(self, epoch: int = 0) -> int:
        """How many sequences epoch `epoch` packs into (varies a little with the shuffle)."""
        return self._plan(epoch).num_sequences

    def sequences_in(self, epochs: Fraction) -> Fraction:
        """The sequences of the first `epochs` epochs: the whole epochs' plans, and the fraction of the next."""
        whole = math.floor(epochs)
        while len(self._epoch_starts) <= whole:
            self._grow_starts()
        rest = epochs - whole
        return self._epoch_starts[whole] + (rest * self.sequences_per_epoch(whole) if rest else 0)

    def doc_batch(self, step: int, size: int) -> DocBatch:
        """Sequences step*size ... (step+1)*size - 1 with their document layout."""
        n = self.seq_len
        ids = np.full((size, n), self.pad_id, dtype=np.int64)
        labels = np.full((size, n), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((size, n), dtype=np.int64)
        seg = np.zeros((size, n), dtype=np.int64)
        seqlens = []
        for r, pieces in enumerate(self.pieces(step, size)):
            at = 0
            for i, (d, s, length) in enumerate(pieces):
                doc_ids, doc_target = self.corpus.doc(d)
                ids[r, at:at + length] = doc_ids[s:s + length]
                nxt = slice(s + 1, min(s + length + 1, len(doc_ids)))  # next tokens, same document
                span = nxt.stop - nxt.start
                labels[r, at:at + span] = np.where(doc_target[nxt], doc_ids[nxt], IGNORE_INDEX)
                pos[r, at:at + length] = np.arange(length)
                seg[r, at:at + length] = i
                seqlens.append(length)
                at += length
            if at < n:  # the padding is one more segment, so segments tile the row
                pos[r, at:] = np.arange(n - at)
                seg[r, at:] = len(pieces)
                seqlens.append(n - at)
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int32), 0)
        return DocBatch(*(torch.from_numpy(a) for a in (ids, labels, pos, seg)), cu)

    def pieces(self, step: int, size: int) -> list[list[tuple[int, int, int]]]:
        """Each row's (document, first token, length) pieces, in order, of sequences step*size ... ."""
        rows = []
        for r in range(size):
            epoch, k = self._locate(step * size + r)
            plan = self._plan(epoch)
            rows.append([(int(plan.doc[j]), int(plan.start[j]), int(plan.length[j]))
                         for j in range(plan.ptr[k], plan.ptr[k + 1])])
        return rows

    def global_batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), LongTensor[size, seq_len], as PackedStream.global_batch."""
        batch = self.doc_batch(step, size)
        return batch.input_ids, batch.labels

    def positions(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(position_ids, doc_ids) of the rows global_batch(step, size) returns."""
        batch = self.doc_batch(step, size)
        return batch.position_ids, batch.doc_ids

    def epoch_at(self, step: int, size: int) -> float:
        """How many epochs the first `step` global batches consumed (for logging)."""
        epoch, k = self._locate(step * size)
        return epoch + k / self._plan(epoch).num_sequences


def cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """int32 segment boundaries over doc_ids.flatten() (rows of any slice of a
    DocBatch, e.g. one micro-batch): where the segment index changes or a row starts
    (the model's varlen boundaries, megaft.models.attention.documents.segments)."""
    return segments(doc_ids)[0]


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Bool [n, seq, seq]: query i may attend key j iff j <= i in the same segment (the
    reference block-causal mask; True = attend, as SDPA's boolean attn_mask): the model's
    mask (megaft.models.attention.documents.document_mask) without its head dimension."""
    return model_mask(Docs(torch.zeros_like(doc_ids), doc_ids))[:, 0]
