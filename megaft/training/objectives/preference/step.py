"""The step part of a preference run (train.objective = dpo | robust | ipo | simpo | orpo).

Each micro-batch's rows (megaft.training.objectives.preference.data) go through the model once; the
completion log-probs come from the vocab-parallel cross-entropy (megaft.pref.logps), summed
per row (under cp over the cp ranks' chunks, a sum whose backward is the identity: each
rank then back-propagates its own tokens); the objective (megaft.pref.losses, TRL's
definitions) is summed over the micro-batch's pairs and divided by the global batch's pair
count, so the accumulated, dp-reduced gradient is that of the mean over the global batch
for any split. ORPO's SFT term is a token mean over the global batch's chosen rows: each
micro-batch divides its share by that global count. Under pp the last stage computes the
objective from its logits (PipelineRuntime.train_step's `head`); the other stages relay.

The reference (dpo, robust, ipo): pref.reference's checkpoint, built at this layout for the
scoring pass and dropped after it, or by default the model as built, before the first update
(the initial checkpoint; with LoRA the base, the adapters starting at zero); scored over
every pair once, in eval mode, each dp rank a share and one all-reduce. A resumed run scores
it again (from the same initial weights: before loading its checkpoint).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaft.config.pref import needs_reference
from megaft.models.attention.gqa import op_backend
from megaft.models.hf.config import hf_model_config
from megaft.models.moe.metrics import router_weight
from megaft.models.moe.stats import StepRouterStats
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.comm import reduce_from_tp
from megaft.pipeline.runtime import PipelineRuntime
from megaft.pref.batches import PairRows, chosen_rows, rejected_rows
from megaft.pref.logps import SequenceLogps, decoder_token_logps, sequence_logps, token_logps
from megaft.pref.losses import METRICS, ORPO_METRICS, preference_loss
from megaft.pref.packing import segment_sums
from megaft.pref.scores import fingerprint_parts, load_scores, save_scores, scores_path
from megaft.training.objectives.preference.data import PairBatch, context_chunks, row_length
from megaft.training.protocols import RunParts
from megaft.training.step import PipelineStep, PlainStep, precision_autocast

log = logging.getLogger(__name__)
# token log-probs [rows, seq] of a micro-batch's (inputs, scored labels, docs)
Scorer = Callable[[torch.Tensor, torch.Tensor, object], Optional[torch.Tensor]]


def _scored(labels: torch.Tensor, whole: Optional[torch.Tensor]) -> torch.Tensor:
    """The targets to score: the answers', plus ORPO's whole chosen rows (a superset on those rows)."""
    return labels if whole is None else torch.where(whole != -100, whole, labels)


def _sequences(logps: torch.Tensor, labels: torch.Tensor, whole: Optional[torch.Tensor], grid: ParallelGrid,
               segments: Optional[torch.Tensor] = None, n_pairs: int = 0
               ) -> tuple[SequenceLogps, Optional[SequenceLogps]]:
    """Per-row sums of the token log-probs under `labels` (and `whole`), over the cp chunks;
    packed rows (`segments`): per answer, in the unpacked rows' order."""
    def sums(targets: torch.Tensor) -> SequenceLogps:
        if segments is None:
            return sequence_logps(logps, targets)
        return SequenceLogps(*segment_sums(logps, targets, segments, 2 * n_pairs))
    out = [sums(labels)] + ([sums(whole)] if whole is not None else [])
    if grid.cp_size > 1:  # each cp rank holds two chunks of every row; the backward is each rank's own tokens
        out = [SequenceLogps(reduce_from_tp(s.sum, grid.cp_group), all_reduce(s.count.clone(), grid.cp_group))
               for s in out]
    return out[0], (out[1] if whole is not None else None)


def logits_scorer(model, grid: ParallelGrid, temperature: float = 1.0
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Token log-probs from this tp rank's vocabulary slice of the logits (a pipeline's last stage),
    of logits / temperature."""
    backend = op_backend(model.kernels, "cross_entropy")

    def score(logits: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        logits = logits if temperature == 1.0 else logits / temperature
        return token_logps(logits[:, :scored.shape[1]], scored, group=grid.tp_group,
                           vocab_size=model.cfg.vocab_size, backend=backend)
    return score


@torch.no_grad()
def score_pairs(score: Scorer, rows: PairRows, chunks: list[torch.Tensor], grid: ParallelGrid, multiple: int = 1
                ) -> torch.Tensor:
    """[pairs of `rows`, 4] (chosen sum, chosen count, rejected sum, rejected count) under
    `score` of the pairs in `chunks` (one forward each, unpacked rows), zeros elsewhere and on
    a pipeline stage before the last."""
    out = torch.zeros(len(rows), 4, dtype=torch.float32, device=grid.device)
    for chunk in chunks:
        inputs, labels = rows.rows(chunk)
        n = row_length(labels, multiple)
        inputs, (labels,), docs = context_chunks(inputs[:, :n], [labels[:, :n]], grid)
        labels = labels.to(grid.device)
        logps = score(inputs.to(grid.device), labels, docs)
        if logps is None:  # a pipeline stage before the last: every stage took part, the last one scored
            continue
        seq, _ = _sequences(logps, labels, None, grid)
        out[chunk.to(grid.device)] = torch.stack([chosen_rows(seq.sum), chosen_rows(seq.count).float(),
                                                  rejected_rows(seq.sum), rejected_rows(seq.count).float()], 1)
    return out


def reference_logps(score: Scorer, rows: PairRows, grid: ParallelGrid, micro_batch_size: int, multiple: int = 1
                    ) -> torch.Tensor:
    """`score_pairs` of every pair: chunks of `micro_batch_size` pairs round-robin over dp;
    under pp the last stage's sums, shared over pp; one sum over dp."""
    chunks = list(torch.arange(len(rows)).split(micro_batch_size))[grid.dp_rank::grid.dp_size]
    out = score_pairs(score, rows, chunks, grid, multiple)
    if grid.pp_size > 1:
        all_reduce(out, grid.pp_group)  # the last stage's sums, zeros elsewhere
    return all_reduce(out, grid.dp_group)  # each pair scored by one dp rank, zeros elsewhere


class PairObjective:
    """The objective of train.objective on a micro-batch's row log-probs, and the step's TRL metrics.
    `reference`: every pair's reference log-probs (precomputed); `online`: a function scoring a
    batch's pairs instead, called when the batch starts (pref.reference_mode=online)."""

    def __init__(self, cfg, grid: ParallelGrid, reference: Optional[torch.Tensor],
                 online: Optional[Callable[[PairBatch], torch.Tensor]] = None):
        self.objective, self.settings, self.grid, self.reference = cfg.train.objective, cfg.pref, grid, reference
        self.online = online
        self.names = METRICS + (ORPO_METRICS if self.objective == "orpo" else ())
        self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=grid.device)
        self.pairs = 0

    def start(self, batch: PairBatch) -> None:
        self.sums.zero_()
        self.pairs = batch.n_targets
        if self.online is not None:
            self.reference = self.online(batch)

    def losses(self, logps: torch.Tensor, batch: PairBatch, i: int) -> torch.Tensor:
        """Per-pair losses of micro-batch `i` from its token log-probs (its metrics summed in)."""
        device, s = self.grid.device, self.settings
        whole = batch.whole_labels[i].to(device) if batch.whole_labels else None
        segments = batch.segments[i].to(device) if batch.segments else None
        seq, nll = _sequences(logps, batch.labels[i].to(device), whole, self.grid, segments,
                              len(batch.pair_ids[i]))
        chosen = SequenceLogps(chosen_rows(seq.sum), chosen_rows(seq.count))
        rejected = SequenceLogps(rejected_rows(seq.sum), rejected_rows(seq.count))
        extra = {}
        if self.reference is not None:
            ref = self.reference[batch.pair_ids[i].to(device)]
            extra = dict(ref_chosen=SequenceLogps(ref[:, 0], ref[:, 1]),
                         ref_rejected=SequenceLogps(ref[:, 2], ref[:, 3]))
        if nll is not None:  # this micro-batch's share of the global batch's token mean
            extra = dict(chosen_nll=SequenceLogps(chosen_rows(nll.sum), chosen_rows(nll.count)),
                         nll_tokens=batch.nll_tokens * chosen.sum.shape[0] / batch.n_targets)
        losses, metrics = preference_loss(self.objective, chosen, rejected, **extra, beta=s.beta,
                                          label_smoothing=s.label_smoothing, gamma=s.gamma)
        self.sums += torch.stack([metrics[n].detach().double().sum() for n in self.names])
        return losses

    def record(self) -> dict[str, float]:
        """TRL's rewards/*, logps/* (and ORPO's) of the step: means over its global batch (over
        pp: the last stage's; collective over pp and dp)."""
        values = self.sums.clone()
        if self.grid.pp_size > 1:
            all_reduce(values, self.grid.pp_group)
        values = all_reduce(values, self.grid.dp_group) / self.pairs
        return dict(zip(self.names, values.tolist()))


def _objectives(parts: RunParts, score: Scorer, model) -> tuple[PairObjective, Optional[PairObjective],
                                                               Optional[float]]:
    """The objective on the training pairs and on the held-out ones (None without), each with
    its pairs' reference log-probs when the objective has a reference (scored in eval mode,
    whole params), and the seconds that scoring took (None without a reference, or online:
    the reference model `model` scores each batch's pairs when it starts)."""
    cfg, data, grid = parts.cfg, parts.data, parts.grid
    if needs_reference(cfg.train.objective) and cfg.pref.reference_mode == "online":
        model.eval().requires_grad_(False)  # a frozen copy, in eval mode as TRL's ref_model

        def online(rows: PairRows) -> Callable[[PairBatch], torch.Tensor]:
            return lambda batch: score_pairs(score, rows, batch.pair_ids, grid, data.multiple)
        held_out = PairObjective(cfg, grid, None, online(data.eval_rows)) if data.eval_rows is not None else None
        return PairObjective(cfg, grid, None, online(data.rows)), held_out, None
    refs, seconds = [None, None], None
    stored = _stored_scores(cfg, data, grid) if needs_reference(cfg.train.objective) and cfg.pref.scores else None
    if stored is not None:
        refs = [r.to(grid.device) if r is not None else None for r in stored]
    elif needs_reference(cfg.train.objective):
        start = time.perf_counter()
        was_training = model.training
        model.eval()  # TRL's reference model runs in eval mode (no dropout)
        # ZeRO-3 shards the policy only: pref.reference's model is built whole
        whole = parts.optim.whole_params() if model is parts.model else contextlib.nullcontext()
        with whole:
            refs = [reference_logps(score, rows, grid, cfg.train.micro_batch_size, data.multiple)
                    if rows is not None else None for rows in (data.rows, data.eval_rows)]
        model.train(was_training)
        if grid.device.type == "cuda":
            torch.cuda.synchronize(grid.device)
        seconds = time.perf_counter() - start
        if cfg.pref.scores and grid.rank == 0:  # for the runs after this one (megaft.pref.scores)
            save_scores(scores_path(cfg), refs[0], refs[1], fingerprint_parts(cfg))
    held_out = PairObjective(cfg, grid, refs[1]) if data.eval_rows is not None else None
    return PairObjective(cfg, grid, refs[0]), held_out, seconds


def _stored_scores(cfg, data, grid: ParallelGrid) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """pref.scores' stored reference log-probs of these pairs, when every rank found them (the
    scoring is collective: all ranks read, or all score)."""
    path = scores_path(cfg)
    stored = load_scores(path, len(data.rows), len(data.eval_rows) if data.eval_rows is not None else None)
    found = torch.tensor([float(stored is not None)], device=grid.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if not found.item():
        return None
    if grid.rank == 0:
        log.info("reference log-probs of %d pairs read from %s (pref.scores)", len(data.rows), path)
    return stored


@torch.no_grad()
def eval_pairs_loss(objective: Optional[PairObjective], batch: Optional[PairBatch], score: Scorer, model,
                    grid: ParallelGrid) -> Optional[float]:
    """The mean pair loss over the held-out pairs (every one once: `batch` holds this rank's),
    the model in eval mode; under pp the last stage's, shared."""
    if objective is None or batch is None:
        return None
    was_training = model.training
    model.eval()
    batch = batch.on(grid.device)
    objective.start(batch)
    total = torch.zeros((), dtype=torch.float64, device=grid.device)
    for i, (inputs, labels) in enumerate(zip(batch.inputs, batch.labels)):
        whole = batch.whole_labels[i].to(grid.device) if batch.whole_labels else None
        logps = score(inputs.to(grid.device), _scored(labels.to(grid.device), whole),
                      batch.docs[i] if batch.docs else None)
        if logps is not None:
            total += objective.losses(logps, batch, i).double().sum()
    model.train(was_training)
    if grid.pp_size > 1:
        all_reduce(total, grid.pp_group)
    return (all_reduce(total, grid.dp_group) / batch.n_targets).item()


def reference_model(parts: RunParts, build_model: Callable[[RunParts], torch.nn.Module]) -> Optional[torch.nn.Module]:
    """The reference model at this rank's layout (tp/pp shards, whole under ZeRO: it is only
    read), without adapters: pref.reference's checkpoint, or under reference_mode=online the
    starting model built again (the same init_from or seeded init; with LoRA the base); None
    when the reference is the starting model scored before training."""
    cfg = parts.cfg
    online = cfg.pref.reference_mode == "online"
    if not needs_reference(cfg.train.objective) or (cfg.pref.reference is None and not online):
        return None
    ref = copy.deepcopy(cfg)
    if cfg.pref.reference is not None:
        ref.model = hf_model_config(cfg.pref.reference, base=cfg.model)  # validated: the policy's architecture
    ref.lora.rank = 0
    return build_model(dataclasses.replace(parts, cfg=ref))


class PreferenceStep(PlainStep):
    """Forward and backward of a step's pairs under a preference objective (pp = 1)."""

    def __init__(self, parts: RunParts, build_model: Callable[[RunParts], torch.nn.Module]):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, parts.optim, grid, parts.phases, precision_autocast(cfg.precision, grid.device))
        scorer, self.data = reference_model(parts, build_model) or self.model, parts.data

        def score(inputs, scored, docs, model=scorer):
            with self.autocast():
                return decoder_token_logps(model, inputs, scored, docs)
        self.pairs, self.held_out, self.reference_s = _objectives(parts, score, scorer)
        self.score = functools.partial(score, model=self.model)

    def forward_backward(self, batch: PairBatch, divisor: float) -> torch.Tensor:
        """Backpropagate sum(pair losses) / divisor over the micro-batches (a mixture of experts:
        plus its router terms, each micro-batch's over its tokens, averaged over the global
        batch's micro-batches as TRL adds them); the pair-loss sum (fp64)."""
        phase, device, model = self.phases.phase, self.grid.device, self.model
        batch = batch.on(device)  # every tensor copied once (the .to(device) below: no-ops)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.pairs.start(batch)
        self.router_stats = StepRouterStats.of(model)
        weight = router_weight(batch.n_targets, len(batch.inputs), self.grid.dp_size, model.routing)
        for i in range(len(batch.inputs)):
            if i == len(batch.inputs) - 1:
                self.optim.arm_reduction()  # buckets reduce during the last backward only
            whole = batch.whole_labels[i].to(device) if batch.whole_labels else None
            with phase("forward"), self.autocast():
                scored = _scored(batch.labels[i].to(device), whole)
                logps = decoder_token_logps(model, batch.inputs[i].to(device), scored,
                                            batch.docs[i] if batch.docs else None,
                                            router_valid=batch.valid[i] if batch.valid else None)
                losses = self.pairs.losses(logps, batch, i)
                router = model.router_losses() if model.cfg.n_experts > 0 else None
            objective = losses.sum()
            if router is not None:
                objective = objective + router.local * weight
                self.router_stats.add(router)
            with phase("backward"):
                (objective / divisor).backward()
            loss_sum += losses.detach().sum().double()
        return loss_sum

    def total_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The global batch's pair-loss sum: over dp only (every cp rank holds the same pairs' losses)."""
        with self.phases.phase("comm"):
            all_reduce(loss_sum, self.grid.dp_group)
        return loss_sum

    def step_metrics(self) -> dict[str, float]:
        """TRL's metrics, and a mixture of experts' aux_loss, z_loss and expert loads."""
        return {**self.pairs.record(), **self.router_stats.record(self.grid.dp_group)}

    def eval_loss(self, batches) -> Optional[float]:
        """The mean pair loss of data.eval_path's pairs (SFT's eval lines, `batches`, are none)."""
        return eval_pairs_loss(self.held_out, self.data.eval_batch(), self.score, self.model, self.grid)


class PipelinePreferenceStep(PipelineStep):
    """A preference objective through the rank's pipeline schedule (pp > 1): the last stage
    turns each micro-batch's logits into its pairs' losses."""

    def __init__(self, parts: RunParts, build_model: Callable[[RunParts], torch.nn.Module]):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, grid, cfg, parts.phases, precision_autocast(cfg.precision, grid.device))
        self.logps = logits_scorer(self.model, grid)
        other = reference_model(parts, build_model)
        runtime = self.runtime if other is None else PipelineRuntime(other, grid, cfg.parallel.schedule,
                                                                     self.runtime.m, cfg.parallel.vpp)

        self.data = parts.data

        def score(inputs, scored, docs, runtime=runtime):
            logits = runtime.forward_logits(inputs, self.autocast, docs)
            return None if logits is None else self.logps(logits, scored)
        self.pairs, self.held_out, self.reference_s = _objectives(parts, score, runtime.model)
        self.score = functools.partial(score, runtime=self.runtime)

    def forward_backward(self, batch: PairBatch, divisor: float) -> torch.Tensor:
        device = self.grid.device
        batch = batch.on(device)
        self.pairs.start(batch)

        def head(i: int, logits: torch.Tensor) -> torch.Tensor:
            whole = batch.whole_labels[i].to(device) if batch.whole_labels else None
            return self.pairs.losses(self.logps(logits, _scored(batch.labels[i].to(device), whole)), batch, i).sum()

        weight = router_weight(batch.n_targets, len(batch.inputs), self.grid.dp_size, self.model.routing)
        return self.run_schedule(batch, divisor, head=head, router_weight=weight, router_valid=batch.valid)

    total_loss = PreferenceStep.total_loss

    def step_metrics(self) -> dict[str, float]:
        """TRL's metrics, and a mixture of experts' aux_loss, z_loss and expert loads (over pp and dp)."""
        return {**self.pairs.record(), **self.runtime.router_stats.record(self.grid.dp_group, self.grid.pp_group)}

    def eval_loss(self, batches) -> Optional[float]:
        return eval_pairs_loss(self.held_out, self.data.eval_batch(), self.score, self.model, self.grid)
