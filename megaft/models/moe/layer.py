"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3): routed experts
and the layer (its router and statistics: megaft.models.moe.router).

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
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig
from megaft.config.moe import MoEConfig
from megaft.kernels.grouped_gemm import grouped_mm
from megaft.kernels.swiglu import swiglu
from megaft.layers.linear import column_input
from megaft.models import recompute
from megaft.models.mlp import MLP  # the shared expert
from megaft.models.moe.capacity import kept_assignments
from megaft.models.moe.combine import combine
from megaft.models.moe.router import Router, RouterLog, RouterRecord
from megaft.parallel.comm import Group, all_gather, group_rank, group_size
from megaft.parallel.expert import dispatch_compute_combine
from megaft.parallel.tensor.comm import reduce_from_tp, reduce_scatter_to_sp
from megaft.parallel.tensor.shard import mark_expert_slice, mark_sequence_parallel, mark_sharded


def _ones(index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Ones like `index` (a count per entry for index_add_: bincount without its host sync)."""
    return torch.ones(index.shape, dtype=dtype, device=index.device)


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
        """This rank's statistics, over its real tokens (not the sequence-parallel padding).
        Padding and shared prompts weigh the tokens instead of selecting them: no host sync."""
        b, s, e = probs.shape
        mine = self._mine(s)
        logits, probs, experts = logits[:, mine], probs[:, mine], experts[:, mine]
        k = experts.shape[-1]
        probs, experts = probs.reshape(-1, e), experts.reshape(-1)
        z = torch.logsumexp(logits, dim=-1).square().reshape(-1)
        if self.log.valid is None:
            counts = torch.zeros(e, device=probs.device).index_add_(0, experts, _ones(experts, probs.dtype))
            self.log.add(RouterRecord(self.layer, counts, probs.sum(0), z.sum(),
                                      torch.full((), float(probs.shape[0]), device=probs.device), dropped))
            return
        # [b, positions] -> per token: 0 (padding), 1, or a count (a shared prompt stands for 2 rows' tokens)
        start = group_rank(self.group) * s if self.sp else 0
        weight = self.log.valid_on(probs.device)[:, start:start + s][:, mine].reshape(-1).to(probs.dtype)
        per_slot = weight.unsqueeze(1).expand(-1, k).reshape(-1)
        counts = torch.zeros(e, dtype=torch.float64, device=probs.device).index_add_(0, experts, per_slot.double())
        self.log.add(RouterRecord(self.layer, counts.to(torch.float32), (probs * weight[:, None]).sum(0),
                                  (z * weight).sum(), weight.sum(), dropped))

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
        valid, tokens = None, None
        if self.log.seq_len is not None and s > self.log.seq_len:  # sequence-parallel padding
            valid = (torch.arange(s, device=experts.device) < self.log.seq_len).repeat(b)
            tokens = b * self.log.seq_len
        keep = kept_assignments(experts.reshape(-1, k), weights.detach().reshape(-1, k), self.n_experts, factor,
                                self.routing.drop_policy, valid, tokens)
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
        # rows sorted by expert (a dropped assignment: key n_experts, sorted last and cut off), the
        # rows per expert counted on the device: the one host sync of the layer is their copy
        key = flat if keep is None else torch.where(keep, flat, self.n_experts)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(self.n_experts + 1, dtype=torch.int64, device=flat.device)
        counts = counts.index_add_(0, key, _ones(key, torch.int64))[:self.n_experts]
        if group_size(self.ep_group) > 1:  # to the experts' ranks and back (megaft.parallel.expert)
            rows = xs.reshape(b * s, d)[order // k]
            if torch.is_autocast_enabled(x.device.type):  # send the compute dtype: half the bytes
                rows = rows.to(torch.get_autocast_dtype(x.device.type))
            y = dispatch_compute_combine(rows, counts, self.ep_group, self.experts)
            order = order[:y.shape[0]]  # the kept rows: the dispatch's host sync knows their number
        else:
            host = counts.cpu()
            order = order if keep is None else order[:int(host.sum())]
            y = self.experts(xs.reshape(b * s, d)[order // k], host)
        # back to (token, slot) order; a dropped assignment's output is zero (without a
        # capacity `order` covers every row: no memset needed)
        back = y.new_empty if keep is None else y.new_zeros
        y = back((b * s * k, y.shape[1])).index_copy(0, order, y)
        out = combine(y.view(b * s, k, d), weights.reshape(b * s, k)).to(x.dtype).view(b, s, d)
        out = reduce_scatter_to_sp(out, self.group) if self.sp else reduce_from_tp(out, self.group)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if residual is None else residual + out
