"""train.objective = grpo: GRPO (and Dr. GRPO, DAPO, BNPO) on logged rollouts (rl.rollouts) or on
rollouts the policy generates each step at the training layout (rl.prompts: megaft.rl.online), as
TRL 1.16's GRPOTrainer defines the loss (megaft.rl.losses) and the advantages (megaft.rl.advantages).

`data`: each step's whole groups (megaft.rl.rollouts), every completion a row (prompt + completion,
the labels on the completion), the advantages computed over the global batch on every rank, then
split over dp into micro-batches of train.micro_batch_size completions, each as long as its
longest row. `step`: each micro-batch's rows through the model once; the per-token log-probs
(vocab-parallel under tp; each cp rank its chunks, their per-completion sums added over cp)
give each completion's loss c_i (megaft.rl.losses.completion_losses), summed and divided by the
global batch's completions, so the dp-reduced, accumulated gradient is the single process's.
Under pp the last stage computes it from its logits. On-policy (rl.num_iterations = 1): the
log-probs the rollouts were sampled with are these weights', so the ratio is 1 with gradient.

rl.num_iterations = mu > 1 (TRL's generate_every = steps_per_generation x mu): a generation's batch
(its groups, rewards and advantages) is trained on for mu optimizer steps, steps g mu .. g mu + mu - 1,
in the same micro-batches; the clipped ratio's old log-probs are the first of those steps' own
forward, detached, and a run resumed inside a generation reads them back from RUN_DIR/rl_state
(megaft.rl.iterations).

rl.mask_truncated_completions: a completion whose last token is no eos (nor the pad id) was cut
at its length limit; its tokens leave the loss, the token counts, the metrics and (a mixture of
experts) the router statistics, as TRL zeroes its completion_mask. It still counts in N and in
its group's rewards.

rl.beta > 0: the KL term's reference model (rl.reference, or the starting model built again;
with LoRA the base without adapters, as TRL's) is kept beside the policy at the same tp/pp
layout, whole under ZeRO (it is only read), in eval mode, and scores each micro-batch's rows
before the policy's forward (under pp: its own pass of the schedule's forwards).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional

import torch

from megaft.checkpoint.state import trim_metrics
from megaft.config.rl import RLConfig
from megaft.data.build import build_tokenizer
from megaft.data.templates import load_chat_template, tokenizer_dir_of
from megaft.data.tokenizer import special_ids
from megaft.inference.generate import Sampling, generate, pipeline_generate
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.moe.metrics import router_weight
from megaft.models.moe.stats import StepRouterStats
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.comm import reduce_from_tp
from megaft.pipeline.runtime import PipelineRuntime
from megaft.pref.logps import decoder_token_logps, token_entropy
from megaft.rl.advantages import completion_metrics, function_metrics, group_advantages
from megaft.rl.iterations import Generation
from megaft.rl.losses import COLUMNS, GlobalCounts, GrpoStats, completion_losses, grpo_terms
from megaft.rl.online import Generate, OnlineRollouts, draw_seed, read_rl_prompts
from megaft.rl.rewards import load_reward, reward_name
from megaft.rl.rollouts import Group, group_rows, logged_rewards, read_rollouts, scored_rewards, step_groups
from megaft.training.model import build_model
from megaft.training.objectives.preference.data import context_chunks, row_length
from megaft.training.objectives.preference.step import PreferenceStep, logits_scorer
from megaft.training.protocols import RunParts, StepBatch, StepPart
from megaft.training.step import PipelineStep, PlainStep, precision_autocast

__all__ = ["build_data", "build_step"]
REWARD_NAME = "rollouts"  # the lines' own rewards' name in rewards/<name>/mean (TRL names each function)


@dataclass
class RolloutBatch(StepBatch):
    """A step's completions on this rank: StepBatch's rows (n_targets = the global batch's
    completions), each micro-batch's advantages, the global counts and the reward metrics."""

    advantages: Optional[list[torch.Tensor]] = None
    counts: Optional[GlobalCounts] = None
    reward_metrics: Optional[dict[str, float]] = None
    # per micro-batch [rows, length]: True at a row's tokens (prompt and completion), what a mixture of
    # experts' router statistics count (transformers' attention_mask in TRL's aux loss)
    valid: Optional[list[torch.Tensor]] = None
    generation: Optional["Generation"] = None  # the batch the step trains on (its old log-probs: mu > 1)
    iteration: int = 0  # which of the generation's rl.num_iterations steps this is


@dataclass
class RolloutData:
    """The data part of a GRPO run (megaft.training.protocols.DataPart): on logged rollouts, or on
    rollouts the policy generates each step (`online`, rl.prompts: megaft.rl.online)."""

    tokenizer: object
    eos_id: Optional[int]
    groups: list[Group]  # logged: every group of rl.rollouts (online: none)
    rewards: Optional[torch.Tensor]  # logged: [groups, G, functions], every completion's rewards (NaN: declined)
    names: list[str]  # the reward functions' names (rewards/<name>/mean)
    rl: RLConfig
    grid: ParallelGrid
    seq_len: int
    pad_id: int
    global_batch_size: int  # completions
    micro_batch_size: int  # completions
    multiple: int = 1  # a micro-batch's length is a multiple of this (sequence parallel: tp; cp: 2 cp tp)
    same_length: bool = False  # pp > 1: every micro-batch of a step as long as the longest
    online: Optional[OnlineRollouts] = None  # rl.prompts: each step's groups generated
    score: Optional[Callable[[list[Group]], torch.Tensor]] = None  # online: rl.reward's [completions, functions]
    run_dir: str = ""  # rank 0 appends each step's first group to RUN_DIR/samples.jsonl (`log_first_group`)
    stop_ids: frozenset = frozenset()  # eos ids and the pad id: a completion ending otherwise was truncated
    save_every: int = 0  # train.save_every: which generations' saved state a resume may still read
    _generation: Optional[Generation] = None  # the generation the current steps train on
    _trimmed: bool = False  # samples.jsonl cut back to the first step this process trains
    task = None
    eval_batches = []
    packing = "none"
    untrained = None

    unit = "completions"

    def units_in(self, epochs: Fraction) -> Fraction:
        """The completions of the first `epochs` passes over the groups or prompts (rl.num_generations each)."""
        n = len(self.online.prompts) if self.online is not None else len(self.groups)
        return epochs * n * self.rl.num_generations * self.rl.num_iterations  # each batch trained mu times

    def _step_groups(self, index: int) -> tuple[list[Group], torch.Tensor]:
        """Generation `index`'s groups and their rewards [completions, functions]."""
        per_step = self.global_batch_size // self.rl.num_generations
        if self.online is not None:  # collective: the policy generates them (megaft.rl.online)
            groups = self.online.groups(index, per_step)
            return groups, self.score(groups)
        ids = step_groups(len(self.groups), index, per_step)
        return [self.groups[i] for i in ids], self.rewards[ids].reshape(-1, len(self.names))

    def layout(self) -> dict:
        """What the saved old log-probs' shapes depend on (Generation.load checks it)."""
        grid = self.grid
        return dict(tp=grid.tp_size, cp=grid.cp_size, dp=grid.dp_size, pp=grid.pp_size,
                    micro_batch_size=self.micro_batch_size, multiple=self.multiple, same_length=self.same_length)

    def generation(self, step: int) -> Generation:
        """The generation step `step` trains on: made at its first step, read back from RUN_DIR when a
        resumed run starts inside it."""
        mu = self.rl.num_iterations
        index = step // mu
        if self._generation is None or self._generation.index != index:
            if step % mu:
                self._generation = Generation.load(self.run_dir, index, step, self.grid, self.layout())
            else:
                self._generation = Generation(index, *self._step_groups(index))
        return self._generation

    def save_generation(self, batch: RolloutBatch) -> None:
        """After the first of a generation's mu > 1 steps (its old log-probs taken): its state on disk,
        for a resume inside it."""
        mu = self.rl.num_iterations
        if mu == 1 or batch.iteration or not self.run_dir:
            return
        step = batch.generation.index * mu
        last_save = step - step % self.save_every if self.save_every > 0 else step
        batch.generation.save(self.run_dir, self.grid, self.layout(), keep_from=last_save // mu)

    def ended(self, groups: list[Group]) -> torch.Tensor:
        """[completions] True where the completion's last token is an eos or the pad id; the others were
        cut at their length limit (TRL's is_truncated), which rl.mask_truncated_completions drops."""
        return torch.tensor([c[-1] in self.stop_ids for grp in groups for c in grp.completion_ids], dtype=torch.bool)

    def batch(self, step: int) -> RolloutBatch:
        g = self.rl.num_generations
        generation = self.generation(step)
        groups, rewards = generation.groups, generation.rewards
        if self.run_dir and self.grid.rank == 0:
            self.log_first_group(step + 1, groups[0], rewards[:g])
        inputs, labels = group_rows(groups, self.seq_len, self.pad_id)
        ended = self.ended(groups)
        truncated = ~ended if self.rl.mask_truncated_completions else torch.zeros_like(ended)
        kept = labels.masked_fill(truncated.unsqueeze(1), -100)  # the loss's labels
        weights = torch.tensor(self.rl.reward_weights or [1.0] * len(self.names))
        advantages, metrics = group_advantages(rewards, weights, g, self.rl.scale_rewards)
        metrics.update(function_metrics(rewards, self.names))
        metrics.update(completion_metrics(torch.tensor([len(c) for grp in groups for c in grp.completion_ids]), ~ended))
        mask = kept != -100
        counts = GlobalCounts(completions=len(advantages), tokens=float(mask.sum()),
                              max_completion_length=self.rl.max_completion_length)
        share = len(advantages) // self.grid.dp_size
        mine = slice(self.grid.dp_rank * share, (self.grid.dp_rank + 1) * share)
        # a truncated completion's tokens are no row's tokens for the router (TRL's attention_mask)
        cut = iter(truncated.tolist())
        lengths = torch.tensor([len(grp.prompt_ids) + (0 if next(cut) else len(c))
                                for grp in groups for c in grp.completion_ids])
        valid = torch.arange(self.seq_len) < lengths.unsqueeze(1)
        # lengths from the unmasked labels: the same micro-batch shapes with and without the mask
        ends = [row_length(lab, self.multiple) for lab in labels[mine].split(self.micro_batch_size)]
        micro = [list(x[mine].split(self.micro_batch_size)) for x in (inputs, kept, advantages, valid)]
        if self.same_length and ends:
            ends = [max(ends)] * len(ends)
        docs = [] if self.grid.cp_size > 1 else None
        for i, n in enumerate(ends):
            micro[0][i], (micro[1][i], micro[3][i]), d = context_chunks(
                micro[0][i][:, :n], [micro[1][i][:, :n], micro[3][i][:, :n]], self.grid)
            if docs is not None:
                docs.append(d)
        tokens = sum(len(grp.prompt_ids) + len(c) for grp in groups for c in grp.completion_ids)
        return RolloutBatch(micro[0], micro[1], docs, len(advantages), tokens, advantages=micro[2], counts=counts,
                            reward_metrics=metrics, valid=micro[3], generation=generation,
                            iteration=step % self.rl.num_iterations)


    def log_first_group(self, step: int, group: Group, rewards: torch.Tensor) -> None:
        """One line of RUN_DIR/samples.jsonl for metrics.jsonl's `step`: the step's first prompt, its G
        completions (decoded without special tokens, as the reward functions read them) and each
        function's rewards (null: declined). A resumed run first drops the lines after its checkpoint."""
        path = os.path.join(self.run_dir, "samples.jsonl")
        if not self._trimmed:
            trim_metrics(path, step - 1)
            self._trimmed = True
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        completions = [decode(c) for c in group.completion_ids]
        line = {"step": step, "prompt": decode(group.prompt_ids), "completions": completions,
                "rewards": {name: [None if math.isnan(v) else v for v in rewards[:, j].tolist()]
                            for j, name in enumerate(self.names)}}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def build_data(parts: RunParts) -> RolloutData:
    """rl.rollouts' groups (read in every rank: validation parsed the file before any started), or
    rl.prompts' prompts, whose groups the policy generates each step (the step part attaches it)."""
    cfg, grid = parts.cfg, parts.grid
    tok = build_tokenizer(cfg.data, init_from=cfg.model.init_from)
    eos_id, pad_id = special_ids(tok, cfg.model.extra.get("eos_token_id"))
    rl = cfg.rl
    par = cfg.parallel
    multiple = (2 * par.cp if par.cp > 1 else 1) * (par.tp if par.sequence_parallel else 1)
    functions = [(spec, load_reward(spec, rl.format_pattern)) for spec in rl.reward]

    def score(groups: list[Group]) -> torch.Tensor:
        return scored_rewards(groups, functions, lambda ids: tok.decode(ids, skip_special_tokens=True))

    shape = dict(seq_len=cfg.data.seq_len, pad_id=pad_id, global_batch_size=cfg.train.global_batch_size,
                 micro_batch_size=cfg.train.micro_batch_size, multiple=multiple, same_length=par.pp > 1)
    names = [reward_name(spec) for spec in rl.reward] if rl.reward else [REWARD_NAME]
    listed = cfg.model.extra.get("eos_token_id")  # a checkpoint may list several (an end of turn)
    shape.update(stop_ids=frozenset({eos_id, pad_id, *(listed if isinstance(listed, list) else [listed])} - {None}),
                 save_every=cfg.train.save_every)
    if rl.prompts:
        template = load_chat_template(cfg.data.chat_template, tokenizer_dir_of(cfg.data.tokenizer, cfg.model.init_from))
        online = OnlineRollouts(read_rl_prompts(rl.prompts, tok, template), num_generations=rl.num_generations,
                                max_completion_length=rl.max_completion_length, seq_len=cfg.data.seq_len, grid=grid,
                                run_dir=parts.run_dir)
        return RolloutData(tok, eos_id, [], None, names, rl, grid, online=online, score=score, run_dir=parts.run_dir,
                           **shape)
    groups = read_rollouts(rl.rollouts, rl.num_generations, rl.max_completion_length, cfg.data.seq_len,
                           cfg.model.vocab_size, scored=bool(rl.reward))
    # scored once: the file and the functions fix every completion's rewards
    rewards = score(groups) if rl.reward else logged_rewards(groups)
    return RolloutData(tok, eos_id, groups, rewards.view(len(groups), rl.num_generations, -1), names, rl, grid,
                       run_dir=parts.run_dir, **shape)


class GrpoObjective:
    """The policy loss of a micro-batch's token log-probs, and the step's TRL metrics."""

    def __init__(self, rl: RLConfig, grid: ParallelGrid):
        self.rl, self.grid = rl, grid
        self.settings = dict(beta=rl.beta, epsilon=rl.epsilon, epsilon_high=rl.epsilon_high, delta=rl.delta,
                             bias_corrected_kl=rl.use_bias_correction_kl)
        self.stats: Optional[GrpoStats] = None
        self.batch: Optional[RolloutBatch] = None

    def start(self, batch: RolloutBatch) -> None:
        self.batch, self.stats = batch, None

    def losses(self, logps: torch.Tensor, i: int, ref_logps: Optional[torch.Tensor] = None,
               entropies: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each completion's loss c_i of micro-batch `i` (its metric sums kept; `entropies`: the
        policy's per-token entropy, for the metric)."""
        batch, device = self.batch, self.grid.device
        labels = batch.labels[i].to(device)
        old = None  # on-policy: the detached log-probs themselves (ratio 1)
        if self.rl.num_iterations > 1 and batch.generation is not None:
            if batch.iteration == 0:  # the generating weights: the ratio's denominator for the mu steps
                batch.generation.old_logps[i] = logps.detach().clone()
            else:
                old = batch.generation.old_logps[i].to(device)
        sums, table = grpo_terms(logps, old, ref_logps, batch.advantages[i].to(device), labels != -100,
                                 entropies=entropies, **self.settings)
        if self.grid.cp_size > 1:  # each cp rank holds chunks of every row: whole-completion sums
            sums = reduce_from_tp(sums, self.grid.cp_group)
            table = all_reduce(table.clone(), self.grid.cp_group)
        stats = GrpoStats.of(table)
        self.stats = stats if self.stats is None else self.stats.add(stats)
        return completion_losses(sums, table[:, 0], batch.counts, self.rl.loss_type)

    def record(self) -> dict[str, float]:
        """TRL's metrics of the step over its global batch (the last pp stage's, over dp)."""
        stats = self.stats
        if stats is None:  # a pipeline stage before the last: neutral values for the reductions
            stats = GrpoStats(torch.zeros(len(COLUMNS), dtype=torch.float32, device=self.grid.device),
                              torch.tensor(float("inf"), device=self.grid.device),
                              torch.tensor(float("-inf"), device=self.grid.device))
        sums, low, high = stats.sums.clone(), stats.low_min.clone(), stats.high_max.clone()
        for group in ([self.grid.pp_group] if self.grid.pp_size > 1 else []) + [self.grid.dp_group]:
            all_reduce(sums, group)  # the last stage's values over pp, then every dp rank's completions
            all_reduce(low, group, torch.distributed.ReduceOp.MIN)
            all_reduce(high, group, torch.distributed.ReduceOp.MAX)
        out = GrpoStats(sums, low, high).metrics(self.rl.beta)
        return {**self.batch.reward_metrics, **out}


def reference_model(parts: RunParts) -> Optional[torch.nn.Module]:
    """rl.beta > 0: the reference at this rank's layout, without adapters, frozen in eval mode
    (rl.reference's checkpoint, or the starting model built again); None at rl.beta = 0."""
    cfg = parts.cfg
    if cfg.rl.beta == 0.0:
        return None
    ref = copy.deepcopy(cfg)
    if cfg.rl.reference is not None:
        ref.model = hf_model_config(cfg.rl.reference, base=cfg.model)  # validated: the policy's architecture
    ref.lora.rank = 0
    return build_model(dataclasses.replace(parts, cfg=ref)).eval().requires_grad_(False)


class GrpoStep(PlainStep):
    """Forward and backward of a step's completions under GRPO (pp = 1)."""

    def __init__(self, parts: RunParts):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, parts.optim, grid, parts.phases, precision_autocast(cfg.precision, grid.device))
        self.objective = GrpoObjective(cfg.rl, grid)
        self.data: RolloutData = parts.data  # saves each generation's state (rl.num_iterations > 1)
        self.reference = reference_model(parts)
        self.temperature = cfg.rl.temperature  # the log-probs of logits / T, the policy's and the reference's

    def _ref_logps(self, batch: RolloutBatch, i: int) -> Optional[torch.Tensor]:
        if self.reference is None:
            return None
        device = self.grid.device
        with torch.no_grad(), self.autocast():
            return decoder_token_logps(self.reference, batch.inputs[i].to(device), batch.labels[i].to(device),
                                       batch.docs[i] if batch.docs else None, temperature=self.temperature)

    def forward_backward(self, batch: RolloutBatch, divisor: float) -> torch.Tensor:
        """Backpropagate sum(c_i) / divisor over the micro-batches (a mixture of experts: plus its
        router terms, each micro-batch's over its tokens, averaged over the global batch's
        micro-batches as TRL adds them); the c_i sum (fp64)."""
        phase, device, model = self.phases.phase, self.grid.device, self.model
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.objective.start(batch)
        self.router_stats = StepRouterStats.of(model)
        weight = router_weight(batch.n_targets, len(batch.inputs), self.grid.dp_size, model.routing)
        for i in range(len(batch.inputs)):
            if i == len(batch.inputs) - 1:
                self.optim.arm_reduction()  # buckets reduce during the last backward only
            with phase("forward"):
                ref = self._ref_logps(batch, i)
                with self.autocast():
                    logps, entropies = decoder_token_logps(
                        model, batch.inputs[i].to(device), batch.labels[i].to(device),
                        batch.docs[i] if batch.docs else None, temperature=self.temperature,
                        router_valid=batch.valid[i] if batch.valid else None, entropy=True)
                    losses = self.objective.losses(logps, i, ref, entropies)
                    router = model.router_losses() if model.cfg.n_experts > 0 else None
            objective = losses.sum()
            if router is not None:
                objective = objective + router.local * weight
                self.router_stats.add(router)
            with phase("backward"):
                (objective / divisor).backward()
            loss_sum += losses.detach().double().sum()
        self.data.save_generation(batch)
        return loss_sum

    # the global batch's c_i sum: over dp only (every cp rank holds the same completions' losses)
    total_loss = PreferenceStep.total_loss

    def step_metrics(self) -> dict[str, float]:
        """TRL's metrics, and a mixture of experts' aux_loss, z_loss and expert loads (over dp)."""
        return {**self.objective.record(), **self.router_stats.record(self.grid.dp_group)}

    def eval_loss(self, batches) -> Optional[float]:
        return None  # no held-out rollouts yet


class PipelineGrpoStep(PipelineStep):
    """GRPO through the rank's pipeline schedule (pp > 1): the last stage turns each micro-batch's
    logits into its completions' losses."""

    def __init__(self, parts: RunParts):
        cfg, grid = parts.cfg, parts.grid
        super().__init__(parts.model, grid, cfg, parts.phases, precision_autocast(cfg.precision, grid.device))
        self.logps = logits_scorer(self.model, grid, cfg.rl.temperature)
        self.temperature = cfg.rl.temperature
        self.objective = GrpoObjective(cfg.rl, grid)
        self.data: RolloutData = parts.data  # saves each generation's state (rl.num_iterations > 1)
        reference = reference_model(parts)
        self.reference: Optional[PipelineRuntime] = None if reference is None else PipelineRuntime(
            reference, grid, cfg.parallel.schedule, self.runtime.m, cfg.parallel.vpp)

    def _ref_logps(self, batch: RolloutBatch) -> list[Optional[torch.Tensor]]:
        """Each micro-batch's reference log-probs on the last stage (None elsewhere, or at rl.beta = 0)."""
        if self.reference is None:
            return [None] * len(batch.inputs)
        out, device = [], self.grid.device
        with torch.no_grad():
            for i, inputs in enumerate(batch.inputs):
                logits = self.reference.forward_logits(inputs.to(device), self.autocast,
                                                       batch.docs[i] if batch.docs else None)
                out.append(None if logits is None else self.logps(logits, batch.labels[i].to(device)))
        return out

    def forward_backward(self, batch: RolloutBatch, divisor: float) -> torch.Tensor:
        device = self.grid.device
        self.objective.start(batch)
        with self.phases.phase("forward"):
            refs = self._ref_logps(batch)

        def head(i: int, logits: torch.Tensor) -> torch.Tensor:
            labels = batch.labels[i].to(device)
            entropies = token_entropy(logits[:, :labels.shape[1]].detach() / self.temperature, group=self.grid.tp_group,
                                      vocab_size=self.model.cfg.vocab_size)
            return self.objective.losses(self.logps(logits, labels), i, refs[i], entropies).sum()
        weight = router_weight(batch.n_targets, len(batch.inputs), self.grid.dp_size, self.model.routing)
        loss_sum = self.run_schedule(batch, divisor, head=head, router_weight=weight, router_valid=batch.valid)
        self.data.save_generation(batch)
        return loss_sum

    total_loss = GrpoStep.total_loss

    def step_metrics(self) -> dict[str, float]:
        """As GrpoStep's, the router's over pp and dp."""
        return {**self.objective.record(), **self.runtime.router_stats.record(self.grid.dp_group, self.grid.pp_group)}

    def eval_loss(self, batches) -> Optional[float]:
        return None


def build_step(parts: RunParts) -> StepPart:
    step = PipelineGrpoStep(parts) if parts.grid.pp_size > 1 else GrpoStep(parts)
    if parts.data.online is not None:  # rl.prompts: the policy generates each step's groups
        parts.data.online.generate = rollout_generator(parts, step)
    return step


def rollout_generator(parts: RunParts, step) -> Generate:
    """The policy's sampling at the training layout (megaft.rl.online.Generate): rl.temperature, then
    rl.top_p's nucleus (transformers' order), seeded by train.seed and each prompt's draw_seed; the rank's
    prompts of the step decode as one left-padded batch (megaft.inference.generate), through the
    pipeline's stages under pp, with ZeRO-3's layers gathered once for them; each completion keeps the
    eos that ended it."""
    cfg, grid = parts.cfg, parts.grid
    sampling = Sampling(temperature=cfg.rl.temperature, top_p=cfg.rl.top_p, seed=cfg.train.seed)
    eos = parts.data.eos_id
    listed = cfg.model.extra.get("eos_token_id")  # a checkpoint may list several (an end of turn)
    eos = sorted({eos, *(listed if isinstance(listed, list) else [listed])} - {None})

    def run(asked: dict[int, tuple[list[int], int]], seed_step: int) -> dict[int, list[list[int]]]:
        order, g = sorted(asked), cfg.rl.num_generations
        # every prompt's G rows in one left-padded batch, each prompt's rows drawing from its own generator
        kw = dict(max_new_tokens=[asked[j][1] for j in order for _ in range(g)], eos_id=eos, sampling=sampling,
                  step=[draw_seed(seed_step, j) for j in order for _ in range(g)], keep_eos=True)
        prompts = [asked[j][0] for j in order for _ in range(g)]
        with parts.optim.whole_params():  # once for the rollout phase, not once a prompt
            if isinstance(step.generator, Decoder):
                with step.autocast():
                    out = generate(step.generator, prompts, device=grid.device, **kw)
            else:
                out = pipeline_generate(step.generator, prompts, autocast=step.autocast, **kw)
        return {j: out[n * g:(n + 1) * g] for n, j in enumerate(order)}
    return run
