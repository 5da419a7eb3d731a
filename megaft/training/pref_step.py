"""The data and step parts of a preference run (train.objective = dpo | robust | ipo | simpo | orpo).

Data (`PrefData`): the pairs of data.path tokenized as TRL's DPOTrainer does
(megaft.pref.data), cut to data.seq_len as TRL's max_length cuts them, as rows
(megaft.pref.batches); a step's global batch is `train.global_batch_size` pairs, a
micro-batch `train.micro_batch_size` pairs (2 rows each, chosen and rejected together).

Step (`PreferenceStep`): each micro-batch's rows go through the model once; the completion
log-probs come from the vocab-parallel cross-entropy (megaft.pref.logps), summed per row
(under cp over the cp ranks' chunks, a sum whose backward is the identity: each rank then
back-propagates its own tokens); the objective (megaft.pref.losses, TRL's definitions) is
summed over the micro-batch's pairs and divided by the global batch's pair count, so the
accumulated, dp-reduced gradient is that of the mean over the global batch for any split.
ORPO's SFT term is a token mean over the global batch's chosen rows: each micro-batch
divides its share by that global count.

The reference (dpo, robust, ipo): the model as built, before the first update (the initial
checkpoint; with LoRA the base, the adapters starting at zero), scored over every pair
once, in eval mode, at this layout, each dp rank a share and one all-reduce; a resumed run
scores it again from the same initial weights before loading its checkpoint.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from tokenizers import Tokenizer

from megaft.data import build_tokenizer, special_ids
from megaft.data.templates import load_chat_template, tokenizer_dir_of
from megaft.models.decoder import Decoder
from megaft.models.docs import Docs
from megaft.parallel.comm import all_reduce
from megaft.parallel.context import context_shard
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.comm import reduce_from_tp
from megaft.pref.batches import PairRows, chosen_rows, rejected_rows
from megaft.pref.config import needs_reference
from megaft.pref.data import read_pairs, truncate
from megaft.pref.logps import SequenceLogps, decoder_token_logps, sequence_logps
from megaft.pref.losses import preference_loss
from megaft.training.protocols import RunParts, StepBatch
from megaft.training.step import PlainStep, precision_autocast

log = logging.getLogger(__name__)


@dataclass
class PairBatch(StepBatch):
    """A step's pairs on this rank: StepBatch's rows (n_targets = the global batch's pairs)
    plus, per micro-batch, its pairs' indices and ORPO's labels of every chosen token."""

    pair_ids: Optional[list[torch.Tensor]] = None
    whole_labels: Optional[list[torch.Tensor]] = None  # orpo only
    nll_tokens: int = 0  # orpo: target tokens of the global batch's chosen rows, prompt included


def _length(labels: torch.Tensor, multiple: int) -> int:
    """The tokens of the longest row of `labels` [rows, seq_len] (its last target is at its
    length - 2), rounded up to `multiple` and capped at seq_len (a multiple of it: validated)."""
    targets = (labels != -100).any(0).nonzero()
    n = int(targets[-1]) + 2 if len(targets) else 1
    return min(-(-n // multiple) * multiple, labels.shape[1])


def _shard(rows: torch.Tensor, grid: ParallelGrid, size: int) -> list[torch.Tensor]:
    """This dp rank's micro-batches of `rows` (whole pairs: an even number of rows each)."""
    share = rows.shape[0] // grid.dp_size
    return list(rows[grid.dp_rank * share:(grid.dp_rank + 1) * share].split(size))


def _context(inputs: torch.Tensor, labels: list[torch.Tensor], grid: ParallelGrid):
    """Under cp: this rank's chunks of the rows and of each label tensor, and the Docs
    (positions and ContextShard) the ring reads; else the rows as they are and no Docs."""
    if grid.cp_size == 1:
        return inputs, labels, None
    parts = [context_shard(inputs, lab, None, grid.cp_group) for lab in labels]
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
    task = None  # no generated task
    eval_batches = []  # no held-out pairs yet (validation refuses data.eval_path)
    packing = "none"  # each row one sequence
    untrained = None

    def batch(self, step: int) -> PairBatch:
        ids = self.rows.pair_ids(step, self.global_batch_size)
        inputs, labels = self.rows.rows(ids)
        size = 2 * self.micro_batch_size
        micro_in, micro_lab = _shard(inputs, self.grid, size), _shard(labels, self.grid, size)
        micro_ids = _shard(ids, self.grid, self.micro_batch_size)
        whole, nll_tokens = None, 0
        if self.orpo:
            whole_rows = self.rows.whole_rows(ids)
            whole, nll_tokens = _shard(whole_rows, self.grid, size), int((whole_rows != -100).sum())
        # each micro-batch only as long as its longest row, as TRL pads (the padding is after every
        # real token: causal attention never reads it), in multiples the sequence splits need
        ends = [_length(lab, self.multiple) for lab in micro_lab]
        micro_in = [x[:, :n] for x, n in zip(micro_in, ends)]
        micro_lab = [x[:, :n] for x, n in zip(micro_lab, ends)]
        if whole:
            whole = [x[:, :n] for x, n in zip(whole, ends)]
        docs = None
        if self.grid.cp_size > 1:
            docs, sharded_in, sharded_lab, sharded_whole = [], [], [], []
            for i, mb in enumerate(micro_in):
                lab = [micro_lab[i]] + ([whole[i]] if whole else [])
                x, labs, d = _context(mb, lab, self.grid)
                sharded_in.append(x)
                sharded_lab.append(labs[0])
                docs.append(d)
                if whole:
                    sharded_whole.append(labs[1])
            micro_in, micro_lab, whole = sharded_in, sharded_lab, sharded_whole or None
        return PairBatch(micro_in, micro_lab, docs, self.global_batch_size, self.rows.tokens(ids),
                         pair_ids=micro_ids, whole_labels=whole, nll_tokens=nll_tokens)


def build_pref_data(parts: RunParts) -> PrefData:
    """The pairs of data.path as TRL's DPOTrainer tokenizes them, cut to data.seq_len."""
    cfg, grid = parts.cfg, parts.grid
    data, init_from = cfg.data, cfg.model.init_from
    tok = build_tokenizer(data, init_from=init_from)
    eos_id, pad_id = special_ids(tok, cfg.model.extra.get("eos_token_id"))
    template = load_chat_template(data.chat_template, tokenizer_dir_of(data.tokenizer, init_from))
    eos_token = tok.id_to_token(eos_id) if eos_id is not None else None
    if eos_token is not None and tok.encode(eos_token, add_special_tokens=False).ids != [eos_id]:
        # TRL appends the eos text to each answer; transformers' tokenizer always reads its eos_token as
        # that one token (a special added token), a bare tokenizer.json may not: make it so here too
        tok.add_special_tokens([eos_token])
    pairs = read_pairs(data.path, tok, template, eos_token=eos_token)
    kept = [p for p in (truncate(p, data.seq_len) for p in pairs) if p is not None]
    if len(kept) < len(pairs) and grid.rank == 0:
        log.warning("%s: %d of %d pairs dropped: their prompt alone has data.seq_len=%d tokens or more (as TRL's "
                    "max_length drops them); raise data.seq_len to keep them", data.path, len(pairs) - len(kept),
                    len(pairs), data.seq_len)
    rows = PairRows(kept, data.seq_len, data.seed, pad_id)
    par = cfg.parallel
    multiple = (2 * par.cp if par.cp > 1 else 1) * (par.tp if par.sequence_parallel else 1)
    return PrefData(tok, eos_id, rows, grid, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                    cfg.train.objective == "orpo", multiple)


def _row_logps(model: Decoder, inputs: torch.Tensor, labels: torch.Tensor, docs: Optional[Docs],
               grid: ParallelGrid, extra: Optional[torch.Tensor] = None
               ) -> tuple[SequenceLogps, Optional[SequenceLogps]]:
    """Per-row sums of the target log-probs under `labels` (and under `extra`, targets a
    superset of labels' on the rows it marks: ORPO's whole chosen rows), over the cp chunks."""
    scored = labels if extra is None else torch.where(extra != -100, extra, labels)
    logps = decoder_token_logps(model, inputs, scored, docs)
    out = [sequence_logps(logps, labels)] + ([sequence_logps(logps, extra)] if extra is not None else [])
    if grid.cp_size > 1:  # each cp rank holds two chunks of every row; the backward is each rank's own tokens
        out = [SequenceLogps(reduce_from_tp(s.sum, grid.cp_group), all_reduce(s.count.clone(), grid.cp_group))
               for s in out]
    return out[0], (out[1] if extra is not None else None)


@torch.no_grad()
def reference_logps(model: Decoder, rows: PairRows, grid: ParallelGrid, micro_batch_size: int, autocast,
                    multiple: int = 1) -> torch.Tensor:
    """[pairs, 4] (chosen sum, chosen count, rejected sum, rejected count) of the model as it
    is, over every pair: chunks of `micro_batch_size` pairs round-robin over dp, one sum."""
    out = torch.zeros(len(rows), 4, dtype=torch.float32, device=grid.device)
    was_training = model.training
    model.eval()  # TRL's reference model runs in eval mode (no dropout)
    ids = torch.arange(len(rows))
    for chunk in list(ids.split(micro_batch_size))[grid.dp_rank::grid.dp_size]:
        inputs, labels = rows.rows(chunk)
        n = _length(labels, multiple)
        inputs, (labels,), docs = _context(inputs[:, :n], [labels[:, :n]], grid)
        with autocast():
            seq, _ = _row_logps(model, inputs.to(grid.device), labels.to(grid.device), docs, grid)
        out[chunk.to(grid.device)] = torch.stack([chosen_rows(seq.sum), chosen_rows(seq.count).float(),
                                                  rejected_rows(seq.sum), rejected_rows(seq.count).float()], 1).float()
    model.train(was_training)
    return all_reduce(out, grid.dp_group)  # each pair scored by one dp rank, zeros elsewhere


class PreferenceStep(PlainStep):
    """Forward and backward of a step's pairs under a preference objective (pp = 1)."""

    def __init__(self, parts: RunParts):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, parts.optim, grid, parts.phases, precision_autocast(cfg.precision, grid.device))
        self.objective, self.settings = cfg.train.objective, cfg.pref
        self.sums: dict[str, torch.Tensor] = {}
        self.pairs = 0
        self.reference = None
        if needs_reference(self.objective):
            with parts.optim.whole_params():  # ZeRO-3: whole layers for the scoring pass
                self.reference = reference_logps(self.model, parts.data.rows, grid, cfg.train.micro_batch_size,
                                                 self.autocast, parts.data.multiple)

    def _loss(self, batch: PairBatch, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair losses and metrics of micro-batch `i`."""
        device, s = self.grid.device, self.settings
        whole = batch.whole_labels[i].to(device) if batch.whole_labels else None
        docs = batch.docs[i] if batch.docs else None
        seq, nll = _row_logps(self.model, batch.inputs[i].to(device), batch.labels[i].to(device), docs, self.grid,
                              whole)
        chosen = SequenceLogps(chosen_rows(seq.sum), chosen_rows(seq.count))
        rejected = SequenceLogps(rejected_rows(seq.sum), rejected_rows(seq.count))
        extra = {}
        if self.reference is not None:
            ref = self.reference[batch.pair_ids[i].to(device)]
            extra = dict(ref_chosen=SequenceLogps(ref[:, 0], ref[:, 1]),
                         ref_rejected=SequenceLogps(ref[:, 2], ref[:, 3]))
        if nll is not None:  # this micro-batch's share of the global batch's token mean
            pairs = chosen.sum.shape[0]
            extra = dict(chosen_nll=SequenceLogps(chosen_rows(nll.sum), chosen_rows(nll.count)),
                         nll_tokens=batch.nll_tokens * pairs / batch.n_targets)
        return preference_loss(self.objective, chosen, rejected, **extra, beta=s.beta,
                               label_smoothing=s.label_smoothing, gamma=s.gamma)

    def forward_backward(self, batch: PairBatch, divisor: float) -> torch.Tensor:
        """Backpropagate sum(pair losses) / divisor over the micro-batches; the loss sum (fp64)."""
        phase = self.phases.phase
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        self.sums, self.pairs = {}, batch.n_targets
        for i in range(len(batch.inputs)):
            if i == len(batch.inputs) - 1:
                self.optim.arm_reduction()  # buckets reduce during the last backward only
            with phase("forward"), self.autocast():
                losses, metrics = self._loss(batch, i)
            with phase("backward"):
                (losses.sum() / divisor).backward()
            loss_sum += losses.detach().sum().double()
            for name, values in metrics.items():
                self.sums[name] = self.sums.get(name, 0) + values.detach().double().sum()
        return loss_sum

    def total_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The global batch's pair-loss sum: over dp only (every cp rank holds the same pairs' losses)."""
        with self.phases.phase("comm"):
            all_reduce(loss_sum, self.grid.dp_group)
        return loss_sum

    def step_metrics(self) -> dict[str, float]:
        """TRL's rewards/*, logps/* (and ORPO's) of the last step: means over its global batch."""
        if not self.sums:
            return {}
        names = sorted(self.sums)
        values = all_reduce(torch.stack([self.sums[n] for n in names]), self.grid.dp_group) / self.pairs
        return dict(zip(names, values.tolist()))

    def eval_loss(self, batches) -> Optional[float]:
        return None  # no held-out pairs yet (validation refuses data.eval_path)
