"""train.objective=reward: a reward model on preference pairs, as TRL 1.16's RewardTrainer
trains one (megaft.reward.losses; reward.* in megaft.config.reward).

`data`: the preference objectives' pairs (the same forms and prepared store, megaft.pref), each
row the whole prompt + answer (TRL's RewardTrainer tokenizes prompt + chosen as one text: the
same ids as megaft's prompt_ids + chosen_ids), a pair with a row longer than data.seq_len
dropped (TRL's max_length filter); per micro-batch a mask of each row's last real token, made
from the row lengths before any cp split, and the pairs' margins (a record's "margin", else 0).
`step`: each micro-batch's rows through the model once; the scalar head's score at every
position (megaft.models.decoder.token_scores), read at the last real token (under cp the rank
holding it; a sum over cp whose backward is the identity), Bradley-Terry's loss per pair summed
and divided by the global batch's pairs, so the dp-reduced, accumulated gradient is the single
process's. Under pp the last stage turns each micro-batch's scores into its loss.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megaft.config.data import data_sources
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.comm import reduce_from_tp
from megaft.pref.batches import PairRows, chosen_rows, rejected_rows
from megaft.pref.data import read_pairs
from megaft.pref.store import StoredPairs, pair_tokenizer, prepare_pairs
from megaft.reward.losses import METRICS, length_mask, reward_loss, sequence_rewards
from megaft.reward.margins import read_margins
from megaft.training.agreed import agreed_store
from megaft.training.objectives.preference.data import PairBatch, PrefData, context_chunks
from megaft.training.objectives.preference.step import PreferenceStep
from megaft.training.protocols import RunParts, StepPart
from megaft.training.step import PipelineStep, PlainStep, precision_autocast

__all__ = ["build_data", "build_step"]
log = logging.getLogger(__name__)


@dataclass
class RewardBatch(PairBatch):
    """A step's pairs on this rank: PairBatch's rows (`labels`: each row's last real token, True
    there, cp-chunked with the rows) and each micro-batch's margins [pairs] (None: no margins)."""

    margins: Optional[list[Optional[torch.Tensor]]] = None


@dataclass
class RewardData(PrefData):
    """The data part of a reward run (megaft.training.protocols.DataPart): PrefData's pairs and
    order, as whole rows with their last-token masks."""

    margins: Optional[np.ndarray] = None  # every stored pair's margin (None: no record has one)
    eval_margins: Optional[np.ndarray] = None

    def _pairs(self, rows: PairRows, ids: torch.Tensor, chunks: list[torch.Tensor], n_pairs: int) -> RewardBatch:
        margins = self.margins if rows is self.rows else self.eval_margins
        lengths = [rows.lengths[PairRows._index(chunk)] for chunk in chunks]
        # each micro-batch as long as its longest row (TRL pads so), in the multiples sequence splits need
        ends = [min(-(-int(n.max()) // self.multiple) * self.multiple, rows.seq_len) for n in lengths]
        if self.same_length and ends:
            ends = [max(ends)] * len(ends)
        micro_in, lasts, docs, micro_margins = [], [], [] if self.grid.cp_size > 1 else None, []
        for chunk, n, end in zip(chunks, lengths, ends):
            inputs, _ = rows.rows(chunk)
            inputs, (last,), d = context_chunks(inputs[:, :end], [length_mask(n, end)], self.grid)
            micro_in.append(inputs)
            lasts.append(last)
            if docs is not None:
                docs.append(d)
            micro_margins.append(None if margins is None else
                                 torch.from_numpy(margins[rows.kept[chunk.numpy()]]).float())
        return RewardBatch(micro_in, lasts, docs, n_pairs, rows.tokens(ids), pair_ids=chunks, margins=micro_margins)


def _margins(paths: list[str], rows: PairRows, where: str) -> Optional[np.ndarray]:
    margins = read_margins(paths)
    if margins is not None and len(margins) != len(rows.table):
        raise ValueError(f"{where}: {len(margins)} margins read for {len(rows.table)} stored pairs; fix: prepare "
                         "the data again (megaft-prepare) so the store holds these files")
    return margins


def build_data(parts: RunParts) -> RewardData:
    """The pairs of data.path or data.sources from the prepared store (as the preference objectives
    read them) and of data.eval_path in memory, the margins from the same files."""
    cfg, grid = parts.cfg, parts.grid
    data = cfg.data
    ptok = pair_tokenizer(data, init_from=cfg.model.init_from, eos_token_id=cfg.model.extra.get("eos_token_id"))
    store = agreed_store(data, grid, prepare=prepare_pairs, tokenizer=ptok)
    weights = [s.weight for s in data.sources] if data.sources else None
    rows = PairRows(StoredPairs(store), data.seq_len, data.seed, ptok.pad_id, weights, drop_long=True)
    where = data.path or "data.sources"
    margins = _margins([s.path for s in data_sources(data)], rows, where)
    evals = eval_margins = None
    if data.eval_path:
        pairs = read_pairs(data.eval_path, ptok.tok, ptok.template, eos_token=ptok.eos_token)
        evals = PairRows(pairs, data.seq_len, data.seed, ptok.pad_id, drop_long=True)
        eval_margins = _margins([data.eval_path], evals, data.eval_path)
    if grid.rank == 0:
        for name, r in ((where, rows), (data.eval_path, evals)):
            if r is not None and r.dropped:
                log.warning("%s: %d of %d pairs dropped: a row of each is longer than data.seq_len=%d (TRL's "
                            "RewardTrainer drops them too); raise data.seq_len to keep them", name, r.dropped,
                            r.dropped + len(r), data.seq_len)
        if cfg.model.tie_embeddings:
            log.warning("model.tie_embeddings=true: a reward model has no LM head, so nothing is tied; the "
                        "embedding trains as the input embedding only, and the export's score head is new")
    par = cfg.parallel
    multiple = (2 * par.cp if par.cp > 1 else 1) * (par.tp if par.sequence_parallel else 1)
    return RewardData(ptok.tok, ptok.eos_id, rows, grid, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                      False, multiple, same_length=par.pp > 1, eval_rows=evals, margins=margins,
                      eval_margins=eval_margins)


class RewardObjective:
    """The pair losses of a micro-batch's scores, and the step's TRL metrics (accuracy, margin,
    mean/min/max reward over the global batch)."""

    def __init__(self, coefficient: Optional[float], grid: ParallelGrid):
        self.coefficient, self.grid = coefficient, grid
        self.sums = torch.zeros(len(METRICS), dtype=torch.float64, device=grid.device)
        self.low = torch.full((), float("inf"), dtype=torch.float64, device=grid.device)
        self.high = torch.full((), float("-inf"), dtype=torch.float64, device=grid.device)
        self.pairs = 0

    def start(self, batch: RewardBatch) -> None:
        self.sums.zero_()
        self.low.fill_(float("inf"))
        self.high.fill_(float("-inf"))
        self.pairs = batch.n_targets

    def losses(self, scores: torch.Tensor, batch: RewardBatch, i: int) -> torch.Tensor:
        """Per-pair losses of micro-batch `i` from the head's scores [rows, seq] (its metrics summed in)."""
        device = self.grid.device
        last = batch.labels[i].to(device)
        rewards = sequence_rewards(scores[:, :last.shape[1]], last)
        if self.grid.cp_size > 1:  # one cp rank holds each row's last token, the others add 0
            rewards = reduce_from_tp(rewards, self.grid.cp_group)
        margin = batch.margins[i].to(device) if batch.margins and batch.margins[i] is not None else None
        losses, metrics = reward_loss(chosen_rows(rewards), rejected_rows(rewards), margin, self.coefficient)
        self.sums += torch.stack([metrics[n].double().sum() for n in METRICS])
        detached = rewards.detach().double()
        self.low = torch.minimum(self.low, detached.min())
        self.high = torch.maximum(self.high, detached.max())
        return losses

    def record(self) -> dict[str, float]:
        """TRL's metrics of the step over its global batch (under pp: the last stage's; over dp)."""
        sums, low, high = self.sums.clone(), self.low.clone(), self.high.clone()
        for group in ([self.grid.pp_group] if self.grid.pp_size > 1 else []) + [self.grid.dp_group]:
            all_reduce(sums, group)  # the last stage's values over pp, then every dp rank's pairs
            _extreme(low, group, torch.distributed.ReduceOp.MIN)
            _extreme(high, group, torch.distributed.ReduceOp.MAX)
        out = dict(zip(METRICS, (sums / max(self.pairs, 1)).tolist()))
        return {**out, "min_reward": low.item(), "max_reward": high.item()}


def _extreme(x: torch.Tensor, group, op) -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(x, op=op, group=group)


@torch.no_grad()
def eval_pairs(objective: RewardObjective, batch: Optional[RewardBatch], scores, model,
               grid: ParallelGrid) -> Optional[dict[str, float]]:
    """The held-out pairs' mean loss and TRL's metrics (every pair once: `batch` holds this rank's),
    the model in eval mode; `scores(i, inputs, docs)`: the head's scores of micro-batch i (None on a
    pipeline stage before the last)."""
    if batch is None:
        return None
    was_training = model.training
    model.eval()
    objective.start(batch)
    total = torch.zeros((), dtype=torch.float64, device=grid.device)
    for i, inputs in enumerate(batch.inputs):
        out = scores(inputs.to(grid.device), batch.docs[i] if batch.docs else None)
        if out is not None:
            total += objective.losses(out, batch, i).double().sum()
    model.train(was_training)
    if grid.pp_size > 1:
        all_reduce(total, grid.pp_group)
    loss = (all_reduce(total, grid.dp_group) / batch.n_targets).item()
    return {"eval_loss": loss, **{f"eval_{k}": v for k, v in objective.record().items()}}


class RewardStep(PlainStep):
    """Forward and backward of a step's pairs under the reward objective (pp = 1)."""

    def __init__(self, parts: RunParts):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, parts.optim, grid, parts.phases, precision_autocast(cfg.precision, grid.device))
        self.objective = RewardObjective(cfg.reward.center_rewards_coefficient, grid)
        self.held_out = RewardObjective(cfg.reward.center_rewards_coefficient, grid)
        self.data = parts.data
        self.last_eval: Optional[dict[str, float]] = None

    def forward_backward(self, batch: RewardBatch, divisor: float) -> torch.Tensor:
        """Backpropagate sum(pair losses) / divisor over the micro-batches; the pair-loss sum (fp64)."""
        phase, device = self.phases.phase, self.grid.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.objective.start(batch)
        for i in range(len(batch.inputs)):
            if i == len(batch.inputs) - 1:
                self.optim.arm_reduction()  # buckets reduce during the last backward only
            with phase("forward"), self.autocast():
                scores = self.model(batch.inputs[i].to(device), batch.docs[i] if batch.docs else None)
                losses = self.objective.losses(scores, batch, i)
            with phase("backward"):
                (losses.sum() / divisor).backward()
            loss_sum += losses.detach().double().sum()
        return loss_sum

    # the global batch's pair-loss sum: over dp only (every cp rank holds the same pairs' losses)
    total_loss = PreferenceStep.total_loss

    def step_metrics(self) -> dict[str, float]:
        return self.objective.record()

    def _scores(self, inputs, docs):
        with self.autocast():
            return self.model(inputs, docs)

    def eval_loss(self, batches) -> Optional[float]:
        """The mean pair loss of data.eval_path's pairs (its accuracy and rewards in `last_eval`)."""
        self.last_eval = eval_pairs(self.held_out, self.data.eval_batch(), self._scores, self.model, self.grid)
        return None if self.last_eval is None else self.last_eval["eval_loss"]


class PipelineRewardStep(PipelineStep):
    """The reward objective through the rank's pipeline schedule (pp > 1): the last stage, which
    holds the score head, turns each micro-batch's scores into its pairs' losses."""

    def __init__(self, parts: RunParts):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, grid, cfg, parts.phases, precision_autocast(cfg.precision, grid.device))
        self.objective = RewardObjective(cfg.reward.center_rewards_coefficient, grid)
        self.held_out = RewardObjective(cfg.reward.center_rewards_coefficient, grid)
        self.data = parts.data
        self.last_eval: Optional[dict[str, float]] = None

    def forward_backward(self, batch: RewardBatch, divisor: float) -> torch.Tensor:
        self.objective.start(batch)

        def head(i: int, scores: torch.Tensor) -> torch.Tensor:
            return self.objective.losses(scores, batch, i).sum()
        return self.run_schedule(batch, divisor, head=head)

    total_loss = PreferenceStep.total_loss

    def step_metrics(self) -> dict[str, float]:
        return self.objective.record()

    def _scores(self, inputs, docs):
        return self.runtime.forward_logits(inputs, self.autocast, docs)

    def eval_loss(self, batches) -> Optional[float]:
        self.last_eval = eval_pairs(self.held_out, self.data.eval_batch(), self._scores, self.model, self.grid)
        return None if self.last_eval is None else self.last_eval["eval_loss"]


def build_step(parts: RunParts) -> StepPart:
    return PipelineRewardStep(parts) if parts.grid.pp_size > 1 else RewardStep(parts)
