"""Global gradient-norm clipping that is exact across tensor-parallel shards.

Sharded parameters contribute their local sum of squares, summed over tp ranks;
replicated parameters (norms, row biases) hold the same full gradient on every
tp rank and are counted once, not tp times. Routed experts split over ep ranks add
their squares over the ep group too.
"""
from __future__ import annotations

import torch

from megaft.parallel.comm import Group, all_reduce
from megaft.parallel.tensor.shard import expert_slice_of, shard_of


@torch.no_grad()
def grad_norm(params: list[torch.nn.Parameter], tp_group: Group, pp_group: Group = None) -> torch.Tensor:
    """L2 norm of the full model's gradient (fp32 scalar, equal on every rank).

    Under pipeline parallelism each rank passes the params it owns (a tied copy left
    out) and the squares are summed over `pp_group` too."""
    device = params[0].device
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    experts = torch.zeros(2, dtype=torch.float32, device=device)  # [split over tp, replicated over tp]
    ep_group = None
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().float().pow(2).sum()
        spec, split = shard_of(p), expert_slice_of(p)
        if split is not None:  # routed experts split over ep: summed over ep, and over tp when split there
            experts[int(spec is None)] += sq  # (LoRA's expert A of gate/up, B of down: whole on every tp rank)
            ep_group = split.group
        elif spec is None:
            replicated += sq
        else:  # kv heads copied over tp > n_kv_heads (megaft.models.attention.kv_heads) count once, not once per copy
            sharded += sq / getattr(spec, "replicas", 1)
    if ep_group is not None:  # every rank of an ep group holds the same layers: all call it
        split_tp, whole_tp = all_reduce(experts, ep_group).unbind()
        sharded, replicated = sharded + split_tp, replicated + whole_tp
    return all_reduce(all_reduce(sharded, tp_group) + replicated, pp_group).sqrt()


@torch.no_grad()
def clip_grad_norm_(flat_grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients by min(1, max_norm / (norm + 1e-6)), torch.nn.utils' rule."""
    if max_norm <= 0:
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in flat_grads:
        g.mul_(coef)
