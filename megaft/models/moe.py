"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3) and its router statistics.

`MoE` replaces a block's MLP where `ModelConfig.is_moe(layer)`:

- the router (`gate.weight` [E, dim], replicated) runs in fp32: softmax over the experts,
  top-k, the top-k weights renormalized when `norm_topk_prob` (transformers' order);
- tokens are sorted by expert and each projection is one grouped GEMM over the stacked
  expert weights (`experts.gate_proj`, `up_proj` [E, F, dim], `down_proj` [E, dim, F]; the
  kernel is `kernels.grouped_gemm`, megaft.kernels.grouped_gemm); each token's k outputs
  are put back in token order and summed with their weights in fp32 (no atomics: the
  sum is the same on every layout);
- Qwen2-MoE's shared expert: an MLP every token passes, scaled by sigmoid(shared_expert_gate);
  DeepSeek-V3's shared experts: the same MLP, added as is;
- DeepSeek-V3's router: sigmoid scores, group-limited choice with a correction bias (Router).

Tensor parallel (what megaft builds, and why): each expert is split like the dense MLP,
gate/up by columns and down by rows (Megatron's expert tensor parallelism with etp = tp),
so every tp rank holds a slice of every expert and sees every token of the micro-batch: no
token moves between tp ranks beyond the MLP's own all-gather / reduce-scatter, and the
router, replicated, decides the same experts on every rank. Expert parallelism
(`parallel.ep`) splits the experts over dp×cp replicas instead, each keeping this tp split:
the sorted rows go to their experts' ep rank and back by all-to-all
(megaft.parallel.expert.dispatch), between the ranks of the same tp position. The routing weights enter the
tp region like the activations (`column_input`), so their gradient, partial per rank, is
summed there.

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

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig
from megaft.config.moe import MoEConfig
from megaft.kernels.grouped_gemm import grouped_mm
from megaft.kernels.swiglu import swiglu
from megaft.layers.linear import column_input
from megaft.models import recompute
from megaft.models.mlp import MLP  # the shared expert
from megaft.models.moe_capacity import kept_assignments
from megaft.parallel.comm import Group, all_gather, all_reduce, group_rank, group_size
from megaft.parallel.expert import dispatch_compute_combine
from megaft.parallel.tensor.comm import reduce_from_tp, reduce_scatter_to_sp
from megaft.parallel.tensor.shard import mark_expert_slice, mark_sequence_parallel, mark_sharded


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

    def start(self, seq_len: int, valid: Optional[torch.Tensor] = None) -> None:
        self.records, self.open, self.seq_len, self.valid = [], True, seq_len, valid

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
    its number of micro-batches (megaft.training.global_router counts them before the step)."""
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
    auxiliary-loss-free balancing moves it, megaft.models.moe_balance, never the optimizer)
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


class Experts(nn.Module):
    """The routed experts' stacked weights, each split over tp like the dense MLP
    (gate/up by their F rows, down by its F columns), and the grouped computation.
    Under expert parallelism (`ep_group` of ep > 1 ranks) this rank holds experts
    [ep_rank E/ep, (ep_rank + 1) E/ep) only (an ExpertSlice on each weight)."""

    def __init__(self, cfg: ModelConfig, *, group: Group, kernels: Optional[KernelsConfig], selective: bool,
                 ep_group: Group = None):
        super().__init__()
        tp, f, ep = group_size(group), cfg.expert_ffn, group_size(ep_group)
        if f % tp:
            raise ValueError(f"Experts: the expert inner size {f} is not divisible by tp={tp}")
        if cfg.n_experts % ep:
            raise ValueError(f"Experts: {cfg.n_experts} experts are not divisible by ep={ep}")
        e = cfg.n_experts // ep
        self.gate_proj = mark_sharded(nn.Parameter(torch.empty(e, f // tp, cfg.dim)), 1, f, f)
        self.up_proj = mark_sharded(nn.Parameter(torch.empty(e, f // tp, cfg.dim)), 1, f, f)
        self.down_proj = mark_sharded(nn.Parameter(torch.empty(e, cfg.dim, f // tp)), 2, f, f)
        if ep > 1:
            for w in (self.gate_proj, self.up_proj, self.down_proj):
                mark_expert_slice(w, group_rank(ep_group), ep, cfg.n_experts, ep_group)
        self.backend = _backend(kernels, "grouped_gemm")
        self.swiglu_backend = _backend(kernels, "swiglu")
        self.selective = selective
        self.adapter: Optional[nn.Module] = None  # per-expert LoRA (megaft.peft.experts.ExpertLora)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[rows sorted by expert, dim] -> this rank's partial outputs (summed over tp later);
        `counts`: rows per expert (int64, CPU)."""
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        if torch.is_autocast_enabled(x.device.type):  # the grouped kernels take one dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), tuple(w.to(dtype) for w in weights)
        gate = self._project(0, x, weights, counts)
        up = self._project(1, x, weights, counts)
        h = recompute.run(swiglu, gate, up, self.swiglu_backend, enabled=self.selective)
        return self._project(2, h, weights, counts)

    def _project(self, i: int, x: torch.Tensor, weights: tuple, counts: torch.Tensor) -> torch.Tensor:
        """W_e x for each expert's rows, + s B_e A_e x with adapters (the same rows and counts)."""
        y = grouped_mm(x, weights[i], counts, backend=self.backend)
        if self.adapter is not None:  # the row-parallel down's partial sum is reduced with y's
            y = y + self.adapter.project(("gate_proj", "up_proj", "down_proj")[i], x, counts, self.backend)
        return y


def _backend(kernels: Optional[KernelsConfig], op: str) -> str:
    return "torch" if kernels is None else kernels.for_op(op)


class MoE(nn.Module):
    """The sparse MLP of one block (see the module doc). Input and output as the dense
    MLP's: [batch, seq, dim], a sequence shard under sequence parallel."""

    def __init__(self, cfg: ModelConfig, *, group: Group, sequence_parallel: bool, log: RouterLog,
                 kernels: Optional[KernelsConfig] = None, selective: bool = False, layer: int = 0,
                 ep_group: Group = None, routing: Optional[MoEConfig] = None):
        super().__init__()
        self.group, self.sp, self.log, self.n_experts = group, sequence_parallel, log, cfg.n_experts
        self.layer, self.ep_group, self.routing = layer, ep_group, routing or MoEConfig()
        self._no_drops: Optional[torch.Tensor] = None  # the `dropped` count when nothing can drop
        self.gate = Router(cfg, sequence_parallel)
        self.experts = Experts(cfg, group=group, kernels=kernels, selective=selective, ep_group=ep_group)
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if cfg.shared_expert_ffn_dim:
            shared = MLP(dataclasses.replace(cfg, ffn_dim=cfg.shared_expert_ffn_dim), group=group,
                         sequence_parallel=sequence_parallel, kernels=kernels, selective=selective)
            if cfg.shared_expert_gate:  # Qwen2-MoE: HF mlp.shared_expert, scaled by sigmoid(shared_expert_gate)
                self.shared_expert = shared
                self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False)
                if sequence_parallel:
                    mark_sequence_parallel(self.shared_expert_gate.weight)
            else:  # DeepSeek-V3: HF mlp.shared_experts (n_shared_experts of them as one MLP), no gate
                self.shared_experts = shared

    def _mine(self, s: int) -> slice:
        """The positions of this rank's sequence-parallel slice that are tokens (not padding)."""
        if not (self.sp and self.log.seq_len is not None):
            return slice(0, s)
        start = group_rank(self.group) * s
        return slice(0, max(0, min(s, self.log.seq_len - start)))

    def _record(self, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor,
                dropped: torch.Tensor) -> None:
        """This rank's statistics, over its real tokens (not the sequence-parallel padding)."""
        b, s, e = probs.shape
        mine = self._mine(s)
        logits, probs, experts = logits[:, mine], probs[:, mine], experts[:, mine]
        weight = None
        if self.log.valid is not None:  # only the tokens: [positions, ...] from [b, positions, ...]
            start = group_rank(self.group) * s if self.sp else 0
            valid = self.log.valid.to(probs.device)[:, start:start + s][:, mine]
            if valid.dtype != torch.bool:  # a count per token (a shared prompt stands for 2 rows' tokens)
                weight = valid[valid > 0].to(probs.dtype)
                valid = valid > 0
            logits, probs, experts = logits[valid], probs[valid], experts[valid]
        probs, z = probs.reshape(-1, e), torch.logsumexp(logits, dim=-1).square().reshape(-1)
        if weight is None:
            counts = torch.bincount(experts.reshape(-1), minlength=e).to(torch.float32)
            tokens = torch.tensor(float(probs.shape[0]), device=probs.device)
        else:  # each token counted `weight` times: the statistics of the rows it stands for
            k = experts.shape[-1]
            counts = torch.bincount(experts.reshape(-1), weights=weight.float().repeat_interleave(k),
                                    minlength=e).to(torch.float32)
            probs, z, tokens = probs * weight[:, None], z * weight, weight.float().sum()
        self.log.add(RouterRecord(self.layer, counts, probs.sum(0), z.sum(), tokens, dropped))

    def _kept(self, experts: torch.Tensor, weights: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(the kept assignments [tokens × k] or None: all, the dropped ones of this rank's own
        positions), for the whole micro-batch's `experts` and `weights` [b, s, k] (moe.capacity_factor)."""
        factor = self.routing.capacity_factor
        if factor is None:  # nothing drops: one zero per device, reused (read, never written)
            zero = self._no_drops
            if zero is None or zero.device != experts.device:
                zero = self._no_drops = torch.zeros((), device=experts.device)
            return None, zero
        b, s, k = experts.shape
        valid = None
        if self.log.seq_len is not None and s > self.log.seq_len:  # sequence-parallel padding
            valid = (torch.arange(s, device=experts.device) < self.log.seq_len).repeat(b)
        keep = kept_assignments(experts.reshape(-1, k), weights.detach().reshape(-1, k), self.n_experts, factor,
                                self.routing.drop_policy, valid)
        # this rank's share of the count: its own sequence slice (summed over tp with the other statistics)
        local = s // group_size(self.group) if self.sp else s
        start = group_rank(self.group) * local if self.sp else 0
        mine = keep.view(b, s, k)[:, start:start + local][:, self._mine(local)]
        return keep, (~mine).sum().to(torch.float32)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits, probs, top, local_experts = self.gate(x)
        # every tp rank computes its slice of every expert for the whole micro-batch
        xs = column_input(x, self.group, self.sp)
        weights = column_input(top, self.group, self.sp)  # grads of the weights: partial per rank, summed
        experts = local_experts
        if self.sp and group_size(self.group) > 1:
            experts = all_gather(experts, 1, self.group)
        keep, dropped = self._kept(experts, weights)
        self._record(logits, probs, local_experts, dropped)
        b, s, d = xs.shape
        k = experts.shape[-1]
        flat = experts.reshape(-1)
        if keep is None:
            order = torch.argsort(flat, stable=True)
        else:  # the kept assignments only, by expert
            order = keep.nonzero().squeeze(1)
            order = order[torch.argsort(flat[order], stable=True)]
        counts = torch.bincount(flat[order], minlength=self.n_experts)
        rows = xs.reshape(b * s, d)[order // k]
        if group_size(self.ep_group) > 1:  # to the experts' ranks and back (megaft.parallel.expert)
            if torch.is_autocast_enabled(x.device.type):  # send the compute dtype: half the bytes
                rows = rows.to(torch.get_autocast_dtype(x.device.type))
            y = dispatch_compute_combine(rows, counts, self.ep_group, self.experts)
        else:
            y = self.experts(rows, counts.cpu())
        # back to (token, slot) order; a dropped assignment's output is zero (without a
        # capacity `order` covers every row: no memset needed)
        back = y.new_empty if keep is None else y.new_zeros
        y = back((b * s * k, y.shape[1])).index_copy(0, order, y)
        out = (y.view(b * s, k, d).float() * weights.reshape(b * s, k, 1)).sum(1).to(x.dtype).view(b, s, d)
        out = reduce_scatter_to_sp(out, self.group) if self.sp else reduce_from_tp(out, self.group)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if residual is None else residual + out
