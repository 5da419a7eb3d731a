"""Preference pairs packed several to a row (data.packing=docs), optionally with the prompt
once per pair (pref.share_prompt).

Unshared: a pair is two documents, prompt + chosen and prompt + rejected, each with its own
positions from 0 (megaft.models.attention.documents), labels as in its unpacked row. Shared: the prompt
without its last token is one document S; each answer is a document that starts with that
last prompt token (at the position it has in the prompt) and sees S as its prefix, so the
token predicting the answer's first token is there once per answer, every label is one
token, and S's keys and values serve both answers: p + c + r + 1 tokens instead of
2p + c + r. Either way each scored token sees exactly what it sees in its own row, so the
log-probs, the losses and the gradients equal the unpacked rows' (up to summation order).

Rows are filled first-fit, in pair order, with whole pairs; a row holds up to
2 * data.seq_len tokens (the two unpacked rows of one pair at the longest), so one pair
always fits. `segments` names each token's pair answer as the unpacked rows are ordered
(2j: the chosen answer of the micro-batch's j-th pair, 2j + 1: its rejected one; -1:
padding): the per-answer sums come out in the order `chosen_rows` / `rejected_rows` read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaft.data.batches import IGNORE_INDEX
from megaft.models.attention.documents import Docs
from megaft.pref.data import Pair


@dataclass
class PackedPairs:
    """A micro-batch of pairs as packed rows, all [rows, length]."""

    inputs: torch.Tensor
    labels: torch.Tensor  # the answers' tokens (megaft's shifted labels)
    whole: torch.Tensor  # ORPO's: every next token of prompt + chosen
    segments: torch.Tensor  # 2j / 2j + 1 per answer of pair j (its shared prompt: 2j), -1 padding
    docs: Docs  # positions, document ids and (shared prompts) prefix ids
    copies: torch.Tensor  # the unpacked rows each token stands for: 2 in a shared prompt, 1, 0 padding


@dataclass
class _Piece:
    """One document of a row: its tokens, labels, ORPO labels, first position, segment, and
    whether it is a shared prompt or an answer that sees its pair's shared prompt."""

    ids: list[int]
    labels: list[int]
    whole: list[int]
    start: int
    segment: int
    shared: bool = False
    after_prefix: bool = False


def _next(ids: list[int], first: int) -> list[int]:
    """Labels of `ids`: position t targets ids[t + 1] from position `first` - 1 on."""
    return [ids[t + 1] if t + 1 >= first else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def pair_pieces(pair: Pair, j: int, share_prompt: bool) -> list[_Piece]:
    """The documents of the micro-batch's `j`-th pair."""
    p = pair.prompt_ids
    if not share_prompt:
        out = []
        for k, answer in enumerate((pair.chosen_ids, pair.rejected_ids)):
            ids = p + answer
            whole = _next(ids, 1) if k == 0 else [IGNORE_INDEX] * len(ids)
            out.append(_Piece(ids, _next(ids, len(p)), whole, 0, 2 * j + k))
        return out
    shared = p[:-1]
    out = [_Piece(shared, [IGNORE_INDEX] * len(shared), _next(p, 1)[:len(shared)], 0, 2 * j, shared=True)
           ] if shared else []
    for k, answer in enumerate((pair.chosen_ids, pair.rejected_ids)):
        ids = p[-1:] + answer
        labels = _next(ids, 1)
        out.append(_Piece(ids, labels, labels if k == 0 else [IGNORE_INDEX] * len(ids), len(shared), 2 * j + k,
                          after_prefix=bool(shared)))
    return out


def packed_length(pair: Pair, share_prompt: bool) -> int:
    """The tokens a pair takes in a packed row."""
    p, c, r = len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)
    return p + c + r + 1 if share_prompt else 2 * p + c + r


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` per row: each in turn into the first row with room."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"a packed pair of {n} tokens does not fit a row of {capacity}")
        row = next((k for k, free in enumerate(room) if free >= n), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= n
    return rows


def pack_pairs(pairs: list[Pair], capacity: int, pad_id: int, *, share_prompt: bool, multiple: int = 1,
               min_rows: int = 0, min_length: int = 0) -> PackedPairs:
    """`pairs` (one micro-batch, in order) packed into rows of at most `capacity` tokens, as
    long as the longest row rounded up to `multiple` (at least `min_length`), at least
    `min_rows` rows (pipeline stages exchange one shape: empty rows of padding)."""
    placement = first_fit([packed_length(p, share_prompt) for p in pairs], capacity)
    rows = [[piece for j in row for piece in pair_pieces(pairs[j], j, share_prompt)] for row in placement]
    used = max(sum(len(piece.ids) for piece in row) for row in rows)
    length = max(min(-(-used // multiple) * multiple, capacity), min_length)
    n = max(len(rows), min_rows)
    inputs = torch.full((n, length), pad_id, dtype=torch.long)
    labels = torch.full((n, length), IGNORE_INDEX, dtype=torch.long)
    whole = torch.full((n, length), IGNORE_INDEX, dtype=torch.long)
    segments = torch.full((n, length), -1, dtype=torch.long)
    copies = torch.zeros((n, length), dtype=torch.long)
    positions = torch.zeros((n, length), dtype=torch.long)
    doc_ids = torch.zeros((n, length), dtype=torch.long)
    prefix_ids = torch.zeros((n, length), dtype=torch.long)
    for r, row in enumerate(rows):
        at, prompt = 0, 0
        for d, piece in enumerate(row):
            span = slice(at, at + len(piece.ids))
            inputs[r, span], labels[r, span], whole[r, span] = (torch.tensor(x) for x in (piece.ids, piece.labels,
                                                                                             piece.whole))
            segments[r, span] = piece.segment
            copies[r, span] = 2 if piece.shared else 1
            positions[r, span] = torch.arange(piece.start, piece.start + len(piece.ids))
            doc_ids[r, span] = d
            prompt = d if piece.shared else prompt
            prefix_ids[r, span] = prompt if piece.after_prefix else d
            at += len(piece.ids)
        doc_ids[r, at:] = prefix_ids[r, at:] = len(row)  # the padding: a document of its own
    docs = Docs(positions, doc_ids, prefix_ids=prefix_ids if share_prompt else None)
    return PackedPairs(inputs, labels, whole, segments, docs, copies)


def segment_sums(values: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `values` over the targets of `labels`, their count) per segment 0..n-1. Every
    other position adds to a bin n, cut off: no boolean indexing (its host sync on a GPU)."""
    targets = ((labels != IGNORE_INDEX) & (segments >= 0)).reshape(-1)
    seg = torch.where(targets, segments.reshape(-1), n)
    kept = torch.where(targets, values.reshape(-1), torch.zeros((), dtype=values.dtype, device=values.device))
    sums = torch.zeros(n + 1, dtype=values.dtype, device=values.device).index_add(0, seg, kept)[:n]
    counts = torch.zeros(n + 1, dtype=torch.long, device=values.device).index_add(0, seg, targets.long())[:n]
    return sums, counts


def packed_tokens(pairs: list[Pair], share_prompt: bool) -> int:
    """The real tokens of these pairs once packed."""
    return sum(packed_length(p, share_prompt) for p in pairs)
