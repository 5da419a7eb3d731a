"""The router of a mixture-of-experts layer and its statistics.

`Router` scores the experts in fp32 (softmax top-k, or DeepSeek-V3's grouped sigmoid choice
with a correction bias).

Router statistics: each MoE layer records, for the tokens this rank routed, the top-k
assignment counts and the routing probabilities summed per expert (and the z-loss sum);
`router_losses` turns them into transformers' load-balancing loss. transformers pools the
statistics over the MoE layers before the product (load_balancing_loss_func):
aux = E * sum_e (C_e / (L T)) (P_e / (L T)), C and P summed over layers and tokens. Its
gradient reaches the probabilities through P only (C counts), so with C and T summed over
the ranks that hold the micro-batch's tokens (tp under sequence parallel, cp), each rank's
share E * sum_e C_e P_local_e / (L T)^2 sums to the micro-batch's loss and back-propagates
exactly its tokens' part: every layout equals the single process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.model import ModelConfig
from megaft.parallel.comm import Group, all_reduce, group_size
from megaft.parallel.tensor.shard import mark_sequence_parallel


@dataclass
class RouterRecord:
    """One MoE layer's statistics of the tokens this rank routed in one forward: top-k
    assignments per expert, routing probabilities summed per expert (with grad), the z-loss
    sum (with grad) and the token count."""
    layer: int
    counts: torch.Tensor
    probs: torch.Tensor
    z: torch.Tensor
    tokens: torch.Tensor
    dropped: torch.Tensor  # assignments past the expert capacity among this rank's tokens (moe.capacity_factor)


class RouterLog:
    """The router statistics of one forward, shared by a model's MoE layers. A layer
    records only while the log is open: the replay of a recomputed block in backward
    (model.recompute=full) adds nothing."""

    def __init__(self):
        self.records: list[RouterRecord] = []
        self.open = False
        self.seq_len: Optional[int] = None  # the micro-batch's length before sequence-parallel padding
        # [batch, seq_len] True where a position is a token (preference rows: not the padding after each
        # row, which transformers' attention_mask keeps out of load_balancing_loss_func); None: all are.
        # Integer counts weigh each token (a shared prompt in packed pairs stands for the tokens of 2 rows)
        self.valid: Optional[torch.Tensor] = None
        self._valid_on: dict = {}

    def start(self, seq_len: int, valid: Optional[torch.Tensor] = None) -> None:
        self.records, self.open, self.seq_len, self.valid = [], True, seq_len, valid
        self._valid_on: dict = {}

    def valid_on(self, device: torch.device) -> torch.Tensor:
        """`valid` on `device`, copied once per forward (not once per layer)."""
        if device not in self._valid_on:
            self._valid_on[device] = self.valid.to(device, non_blocking=True)
        return self._valid_on[device]

    def add(self, record: RouterRecord) -> None:
        if self.open:
            self.records.append(record)

    def close(self) -> list[RouterRecord]:
        self.open = False
        records, self.records = self.records, []
        return records


@dataclass
class RouterLosses:
    """One micro-batch's router terms. `local`: this rank's share of
    aux_coef * aux + z_coef * z (it carries the gradient; the shares of the ranks holding the
    micro-batch's tokens, and of the pipeline stages, sum to the whole); `aux`, `z`: the
    micro-batch's values; `counts`: [MoE layers here, experts] top-k assignments of its tokens."""
    local: torch.Tensor
    aux: torch.Tensor
    z: torch.Tensor
    counts: torch.Tensor
    layers: list[int]  # the MoE layers of `counts`' rows
    dropped: torch.Tensor  # [MoE layers here] assignments past the capacity (moe.capacity_factor)


@dataclass
class RouterSums:
    """A micro-batch's statistics over the MoE layers of one forward (a pipeline stage's, or all),
    summed over the ranks holding its tokens ("whole") or this rank's part (with grad)."""
    layers: list[int]
    counts: torch.Tensor  # [layers, experts], whole
    probs: torch.Tensor  # [experts], this rank's, summed over the layers: the gradient's path
    z: torch.Tensor  # this rank's z-loss sum, with grad
    whole_probs: torch.Tensor  # [experts], detached
    whole_z: torch.Tensor  # detached
    tokens: torch.Tensor  # the micro-batch's token count
    dropped: torch.Tensor  # [layers], whole

    def wire(self) -> torch.Tensor:
        """[counts summed over layers (E), probs (E), z, tokens]: what a pipeline stage passes on."""
        return torch.cat([self.counts.sum(0), self.whole_probs, self.whole_z.reshape(1), self.tokens.reshape(1)])


def wire_size(cfg: ModelConfig) -> int:
    """Length of RouterSums.wire for `cfg` (0 for a dense model)."""
    return 2 * cfg.n_experts + 2 if cfg.n_experts > 0 else 0


def sum_records(records: Sequence[RouterRecord], groups: Sequence[Group] = ()) -> Optional[RouterSums]:
    """The records of one forward summed over its layers, their counts and values also over
    `groups`, the process groups the micro-batch's tokens are split over (tp under sequence
    parallel, cp); None without records."""
    if not records:
        return None
    counts = torch.stack([r.counts for r in records])
    probs = torch.stack([r.probs for r in records]).sum(0)
    z = torch.stack([r.z for r in records]).sum()
    tokens = records[0].tokens.to(torch.float32)
    dropped = torch.stack([r.dropped for r in records])
    stats = torch.cat([counts.reshape(-1), probs.detach(), z.detach().reshape(1), tokens.reshape(1), dropped])
    for group in groups:
        if group_size(group) > 1:
            all_reduce(stats, group)
    whole_counts, whole_probs, whole_z, whole_tokens, whole_dropped = stats.split(
        [counts.numel(), probs.numel(), 1, 1, len(records)])
    return RouterSums([r.layer for r in records], whole_counts.view_as(counts), probs, z, whole_probs,
                      whole_z[0], whole_tokens[0], whole_dropped)


@dataclass
class GlobalCounts:
    """moe.aux_scope=global_batch: the top-k assignments per expert (summed over the MoE layers)
    and the token count of the whole global batch (every dp×cp replica and micro-batch), and
    its number of micro-batches (megaft.models.moe.global_router counts them before the step)."""
    counts: torch.Tensor  # [experts]
    tokens: torch.Tensor  # scalar
    micro_batches: int


def router_terms(sums: Optional[RouterSums], total: torch.Tensor, n_layers: int, cfg: ModelConfig,
                 scope: Optional[GlobalCounts] = None) -> RouterLosses:
    """The router losses of a micro-batch whose statistics over all its `n_layers` MoE layers
    are `total` (RouterSums.wire summed over every part of the model); `sums`: this part's
    (None: a pipeline stage without MoE layers, whose share is zero).

    With a global `scope` the counts and tokens are the global batch's: the micro-batch's
    `local` terms over the whole batch sum to the global loss, and its `aux`/`z` values are
    its share × the batch's micro-batches (the step's mean of them is the global value)."""
    n_experts = cfg.n_experts
    counts, probs, z, tokens = total.split([n_experts, n_experts, 1, 1])
    if scope is not None:
        counts, tokens = scope.counts, scope.tokens.reshape(1)
    rows = n_layers * tokens[0]
    c = counts / rows
    aux, z_value = n_experts * (c * probs).sum() / rows, z[0] / rows
    if scope is not None:
        aux, z_value = aux * scope.micro_batches, z_value * scope.micro_batches
    if sums is None:
        return RouterLosses(torch.zeros((), device=total.device), aux, z_value,
                            torch.zeros((0, n_experts), device=total.device), [], torch.zeros(0, device=total.device))
    local = (cfg.router_aux_loss_coef * n_experts * (c * sums.probs).sum() / rows
             + cfg.router_z_loss_coef * sums.z / rows)
    return RouterLosses(local, aux.detach(), z_value.detach(), sums.counts, sums.layers, sums.dropped)


def router_losses(records: Sequence[RouterRecord], cfg: ModelConfig, groups: Sequence[Group] = (),
                  scope: Optional[GlobalCounts] = None) -> Optional[RouterLosses]:
    """The load-balancing loss (transformers' load_balancing_loss_func, pooled over the MoE
    layers of `records`: all of the model's) and the z-loss (mean over tokens and layers of
    logsumexp(logits)^2) of a micro-batch; `groups` as for `sum_records`, `scope` as for
    `router_terms`."""
    sums = sum_records(records, groups)
    return None if sums is None else router_terms(sums, sums.wire(), len(records), cfg, scope)


class Router(nn.Module):
    """`weight` [experts, dim] (HF `mlp.gate.weight`); fp32 logits, scores, top-k.

    softmax scoring (Mixtral, Qwen, OLMoE): softmax over the experts, top-k, renormalized with
    norm_topk_prob. sigmoid scoring (DeepSeek-V3, transformers' DeepseekV3TopkRouter): each
    expert's sigmoid; the choice adds `e_score_correction_bias` (a buffer: DeepSeek's
    auxiliary-loss-free balancing moves it, megaft.models.moe.balance, never the optimizer)
    and keeps the topk_group of n_group groups whose two best biased scores sum highest; the
    weights are the unbiased scores of the chosen experts, renormalized with norm_topk_prob,
    times routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.top_k, self.norm_topk = cfg.top_k, cfg.norm_topk_prob
        self.sigmoid = cfg.router_scoring == "sigmoid"
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        if self.sigmoid:  # saved (HF export, checkpoints), identical on every rank
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))
        if sequence_parallel:  # applied to sequence shards: grads summed over tp
            mark_sequence_parallel(self.weight)
        self.adapter: Optional[nn.Module] = None  # LoRA on the router (megaft.peft.experts): added to the logits

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, scores, top-k weights, top-k experts), all fp32 but the indices."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
            if self.adapter is not None:
                logits = logits + self.adapter(x)
        if self.sigmoid:
            return (logits, *self._grouped(logits))
        probs = torch.softmax(logits, dim=-1)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, probs, top, experts

    def _grouped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's choice, in transformers' order of operations (so its ties break alike)."""
        scores = logits.sigmoid()
        shape, e = scores.shape[:-1], scores.shape[-1]
        flat = scores.reshape(-1, e)
        choice = flat.detach() + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape(-1, e), float("-inf"))
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        top = flat.gather(1, experts)
        if self.norm_topk:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        top = top * self.scaling
        return scores, top.view(*shape, self.top_k), experts.view(*shape, self.top_k)
