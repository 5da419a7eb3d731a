"""The data part of a preference run (train.objective = dpo | robust | ipo | simpo | orpo).

The pairs of data.path or data.sources tokenized as TRL's DPOTrainer does (megaft.pref.data)
into the prepared store once (megaft.pref.store), cut to
data.seq_len as TRL's max_length cuts them, as rows (megaft.pref.batches); a step's global
batch is `train.global_batch_size` pairs, a micro-batch `train.micro_batch_size` pairs (2
rows each, chosen and rejected together), each micro-batch as long as its longest row (all
of a step's alike under pp: the stages exchange one activation shape).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch
from tokenizers import Tokenizer

from megaft.data.ahead import Ahead
from megaft.models.attention.documents import Docs
from megaft.parallel.context import context_shard
from megaft.parallel.grid import ParallelGrid
from megaft.pref.batches import PairRows
from megaft.pref.data import read_pairs
from megaft.pref.packing import PackedPairs, pack_pairs, packed_tokens
from megaft.pref.store import StoredPairs, pair_tokenizer, prepare_pairs
from megaft.training.agreed import agreed_store
from megaft.training.protocols import RunParts, StepBatch

log = logging.getLogger(__name__)


@dataclass
class PairBatch(StepBatch):
    """A step's pairs on this rank: StepBatch's rows (n_targets = the global batch's pairs)
    plus, per micro-batch, its pairs' indices and ORPO's labels of every chosen token."""

    pair_ids: Optional[list[torch.Tensor]] = None
    segments: Optional[list[torch.Tensor]] = None  # packed rows: each token's answer (megaft.pref.packing)
    # per micro-batch [rows, length]: True at tokens, False at padding (shared prompts: the count of
    # unpacked rows each token stands for, 2 in the prompt), what the router statistics count
    valid: Optional[list[torch.Tensor]] = None
    whole_labels: Optional[list[torch.Tensor]] = None  # orpo only
    nll_tokens: int = 0  # orpo: target tokens of the global batch's chosen rows, prompt included

    def on(self, device: torch.device) -> "PairBatch":
        """This batch with its tensors on `device`, each copied once (pinned and non_blocking on
        CUDA: the copies overlap the step's work); docs stay as they are (the model moves them)."""
        def move(ts):
            return None if ts is None else [_to(t, device) for t in ts]
        return dataclasses.replace(self, inputs=move(self.inputs), labels=move(self.labels),
                                   pair_ids=move(self.pair_ids), segments=move(self.segments),
                                   valid=move(self.valid), whole_labels=move(self.whole_labels))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def row_length(labels: torch.Tensor, multiple: int) -> int:
    """The tokens of the longest row of `labels` [rows, seq_len] (its last target is at its
    length - 2), rounded up to `multiple` and capped at seq_len (a multiple of it: validated)."""
    targets = (labels != -100).any(0).nonzero()
    n = int(targets[-1]) + 2 if len(targets) else 1
    return min(-(-n // multiple) * multiple, labels.shape[1])


def _shard(rows: torch.Tensor, grid: ParallelGrid, size: int) -> list[torch.Tensor]:
    """This dp rank's micro-batches of `rows` (whole pairs: an even number of rows each)."""
    share = rows.shape[0] // grid.dp_size
    return list(rows[grid.dp_rank * share:(grid.dp_rank + 1) * share].split(size))


def context_chunks(inputs: torch.Tensor, labels: list[torch.Tensor], grid: ParallelGrid,
                   docs: Optional[Docs] = None):
    """Under cp: this rank's chunks of the rows and of each label tensor, and the Docs
    (positions and ContextShard) the ring reads; else the rows as they are and `docs`
    (packed rows' documents, None for a sequence a row)."""
    if grid.cp_size == 1:
        return inputs, labels, docs
    parts = [context_shard(inputs, lab, docs, grid.cp_group) for lab in labels]
    return parts[0][0], [p[1] for p in parts], Docs(*parts[0][2:])


@dataclass
class PrefData:
    """The data part of a preference run (megaft.training.protocols.DataPart)."""

    tokenizer: Tokenizer
    eos_id: Optional[int]
    rows: PairRows
    grid: ParallelGrid
    global_batch_size: int  # pairs
    micro_batch_size: int  # pairs
    orpo: bool
    multiple: int = 1  # a micro-batch's length is a multiple of this (sequence parallel: tp; cp: 2 cp tp)
    same_length: bool = False  # pp > 1: every micro-batch of a step as long as the longest
    eval_rows: Optional[PairRows] = None  # data.eval_path's pairs
    packing: str = "none"  # none: each row one answer; docs: pairs packed (megaft.pref.packing)
    share_prompt: bool = False  # docs: a pair's prompt once, both answers seeing it
    task = None  # no generated task
    eval_batches = []  # SFT's eval lines: none (the held-out pairs are `eval_batch()`)
    untrained = None

    unit = "pairs"

    def units_in(self, epochs: Fraction) -> Fraction:
        """The pairs of the first `epochs` epochs (each epoch draws the same count: the mixture's)."""
        return epochs * self.rows.epoch_size()

    def __post_init__(self):
        self._ahead = Ahead(self._batch)  # the next step's pairs made while this one trains

    def batch(self, step: int) -> PairBatch:
        return self._ahead(step)

    def _batch(self, step: int) -> PairBatch:
        ids = self.rows.pair_ids(step, self.global_batch_size)
        chunks = _shard(ids, self.grid, self.micro_batch_size)
        return self._pairs(self.rows, ids, chunks, self.global_batch_size)

    def eval_batch(self) -> Optional[PairBatch]:
        """Every held-out pair once: chunks of micro_batch_size pairs, round-robin over dp."""
        if self.eval_rows is None:
            return None
        ids = torch.arange(len(self.eval_rows))
        chunks = list(ids.split(self.micro_batch_size))[self.grid.dp_rank::self.grid.dp_size]
        return self._pairs(self.eval_rows, ids, chunks, len(ids))

    def _pairs(self, rows: PairRows, ids: torch.Tensor, chunks: list[torch.Tensor], n_pairs: int) -> PairBatch:
        """The micro-batches of `chunks` (this rank's pairs of `ids`, the batch's `n_pairs`)."""
        if self.packing == "docs":
            return self._packed(rows, ids, chunks, n_pairs)
        micro_in, micro_lab, whole, valid = [], [], [] if self.orpo else None, []
        for chunk in chunks:
            inputs, labels = rows.rows(chunk)
            micro_in.append(inputs)
            micro_lab.append(labels)
            valid.append(torch.arange(rows.seq_len) < rows.lengths[PairRows._index(chunk)].unsqueeze(1))
            if self.orpo:
                whole.append(rows.whole_rows(chunk))
        # ORPO's SFT term: a token mean over the batch's chosen rows
        nll_tokens = rows.whole_tokens(ids) if self.orpo else 0
        # each micro-batch only as long as its longest row, as TRL pads (the padding is after every
        # real token: causal attention never reads it), in multiples the sequence splits need
        ends = [row_length(lab, self.multiple) for lab in micro_lab]
        if self.same_length and ends:
            ends = [max(ends)] * len(ends)
        docs = [] if self.grid.cp_size > 1 else None
        for i, n in enumerate(ends):
            labels = [micro_lab[i][:, :n], valid[i][:, :n]] + ([whole[i][:, :n]] if self.orpo else [])
            micro_in[i], labels, d = context_chunks(micro_in[i][:, :n], labels, self.grid)
            micro_lab[i], valid[i] = labels[:2]
            if self.orpo:
                whole[i] = labels[2]
            if docs is not None:
                docs.append(d)
        return PairBatch(micro_in, micro_lab, docs, n_pairs, rows.tokens(ids), pair_ids=chunks, whole_labels=whole,
                         nll_tokens=nll_tokens, valid=valid)

    def _packed(self, rows: PairRows, ids: torch.Tensor, chunks: list[torch.Tensor], n_pairs: int) -> PairBatch:
        """`_pairs` with each micro-batch's pairs packed into rows (under pp all of a step's
        micro-batches of one shape: padded to the most rows and the longest)."""
        def pack(chunk: torch.Tensor, min_rows: int = 0, min_length: int = 0) -> PackedPairs:
            return pack_pairs([rows.pair(k) for k in chunk.tolist()], 2 * rows.seq_len, rows.pad_id,
                              share_prompt=self.share_prompt, multiple=self.multiple, min_rows=min_rows,
                              min_length=min_length)
        packed = [pack(chunk) for chunk in chunks]
        if self.same_length and packed:
            most, longest = max(p.inputs.shape[0] for p in packed), max(p.inputs.shape[1] for p in packed)
            packed = [pack(chunk, most, longest) for chunk in chunks]
        micro_in, micro_lab, whole, segments, docs, valid = [], [], [] if self.orpo else None, [], [], []
        for p in packed:
            labels = [p.labels, p.segments, p.copies] + ([p.whole] if self.orpo else [])
            inputs, labels, d = context_chunks(p.inputs, labels, self.grid, p.docs)
            micro_in.append(inputs)
            micro_lab.append(labels[0])
            segments.append(labels[1])
            docs.append(d)
            # the router statistics count each token as often as the unpacked rows hold it: a shared
            # prompt twice (an integer weight), every other token once, the padding never
            valid.append(labels[2] if self.share_prompt else labels[2] > 0)
            if self.orpo:
                whole.append(labels[3])
        nll_tokens = rows.whole_tokens(ids) if self.orpo else 0
        tokens = packed_tokens([rows.pair(k) for k in ids.tolist()], self.share_prompt)
        return PairBatch(micro_in, micro_lab, docs, n_pairs, tokens, pair_ids=chunks, whole_labels=whole,
                         nll_tokens=nll_tokens, segments=segments, valid=valid)


def _dropped(rows: PairRows, where: str, seq_len: int, rank: int) -> PairRows:
    if rows.dropped and rank == 0:
        log.warning("%s: %d of %d pairs dropped: their prompt alone has data.seq_len=%d tokens or more (as TRL's "
                    "max_length drops them); raise data.seq_len to keep them", where, rows.dropped,
                    rows.dropped + len(rows), seq_len)
    return rows


def build_pref_data(parts: RunParts) -> PrefData:
    """The pairs of data.path or data.sources, from the prepared store (megaft.pref.store:
    tokenized once as TRL's DPOTrainer tokenizes them, memory-mapped), and of data.eval_path,
    read into memory."""
    cfg, grid = parts.cfg, parts.grid
    data, init_from = cfg.data, cfg.model.init_from
    ptok = pair_tokenizer(data, init_from=init_from, eos_token_id=cfg.model.extra.get("eos_token_id"))
    store = agreed_store(data, grid, prepare=prepare_pairs, tokenizer=ptok)
    weights = [s.weight for s in data.sources] if data.sources else None
    where = data.path or "data.sources"
    rows = _dropped(PairRows(StoredPairs(store), data.seq_len, data.seed, ptok.pad_id, weights), where,
                    data.seq_len, grid.rank)
    evals = None
    if data.eval_path:
        pairs = read_pairs(data.eval_path, ptok.tok, ptok.template, eos_token=ptok.eos_token)
        evals = _dropped(PairRows(pairs, data.seq_len, data.seed, ptok.pad_id), data.eval_path, data.seq_len,
                         grid.rank)
    par = cfg.parallel
    multiple = (2 * par.cp if par.cp > 1 else 1) * (par.tp if par.sequence_parallel else 1)
    return PrefData(ptok.tok, ptok.eos_id, rows, grid, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                    cfg.train.objective == "orpo", multiple, same_length=par.pp > 1, eval_rows=evals,
                    packing="docs" if data.packing == "docs" else "none", share_prompt=cfg.pref.share_prompt)
