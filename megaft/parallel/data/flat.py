"""FlatParams: parameters and gradients as views into contiguous buffers (fp32, or
bf16 under `optim.master_weights`, where the optimizer keeps the fp32 masters).

One buffer per weight-decay group lets the optimizer run one fused kernel over the
whole model (megaft._C / megaft._cuda take flat tensors) and the data-parallel
reduction run a few large collectives. Autograd accumulates into the existing
`.grad` views in place, so the buffers always hold the gradients.

Each buffer is cut into buckets (`parallel.bucket_mb`) for the dp reduction.
Parameters are laid out in REVERSE model order, because backward produces the
last layers' gradients first: the first bucket of a buffer is the first to be
ready. Every bucket is padded with zeros to a multiple of dp, so ZeRO shards a
bucket into dp equal chunks (Megatron's distributed optimizer layout); a rank's
shard of a buffer is its chunk of every bucket.

Routed expert weights split over ep ranks (an ExpertSlice, megaft.parallel.tensor.shard)
get buffers of their own (`FlatGroup.expert`): they are reduced and ZeRO-sharded over the
expert replicas, not over every dp×cp replica, so their buckets are padded to a multiple
of that group's size (`expert_multiple`).

Parameters named in `momentum_only` (optim.name=muon: the Muon matrices) get buffers of their
own too (`FlatGroup.momentum_only`): their optimizer keeps one state buffer (the momentum, in
exp_avg) and allocates no exp_avg_sq for them (megaft.optim.adamw, megaft.optim.zero).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megaft.parallel.tensor.shard import expert_slice_of


@dataclass
class Bucket:
    """A contiguous range [start, stop) of one group's buffer; (stop - start) % dp == 0."""

    group: int  # index into FlatParams.groups
    start: int
    stop: int
    params: list[nn.Parameter]
    offsets: list[int]  # each param's start in the group's buffer

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class FlatGroup:
    params: list[nn.Parameter]  # in buffer order (reverse model order)
    data: torch.Tensor  # flat values (fp32 or bf16); every param's .data is a view into it
    grad: torch.Tensor | None  # flat gradients, data's dtype (views in .grad); None when not kept (ZeRO-2)
    weight_decay: float
    buckets: list[Bucket] = field(default_factory=list)
    expert: bool = False  # routed experts split over ep: reduced over the expert replicas
    momentum_only: bool = False  # one optimizer state buffer (Muon's momentum): no exp_avg_sq


def plan_buckets(sizes: list[int], cap: int, multiple: int) -> list[tuple[int, int, list[int], list[int]]]:
    """Cut params of `sizes` (buffer order) into buckets of at least `cap` elements (the
    last may be smaller; cap <= 0: one bucket), each padded to a multiple of `multiple`.
    Returns (start, stop, param indices, param offsets) per bucket."""
    plan, start, idx, offs, offset = [], 0, [], [], 0
    for i, n in enumerate(sizes):
        idx.append(i)
        offs.append(offset)
        offset += n
        if (cap > 0 and offset - start >= cap) or i == len(sizes) - 1:
            stop = start + -(-(offset - start) // multiple) * multiple
            plan.append((start, stop, idx, offs))
            start = offset = stop
            idx, offs = [], []
    return plan


def _flatten(index: int, params: list[nn.Parameter], weight_decay: float, device: torch.device, *, cap: int,
             multiple: int, keep_grads: bool, dtype: torch.dtype, expert: bool = False,
             momentum_only: bool = False) -> FlatGroup:
    params = params[::-1]  # backward order: the first-ready grads form the first bucket
    plan = plan_buckets([p.numel() for p in params], cap, multiple)
    total = plan[-1][1] if plan else 0
    data = torch.zeros(total, dtype=dtype, device=device)
    grad = torch.zeros(total, dtype=dtype, device=device) if keep_grads else None
    group = FlatGroup(params, data, grad, weight_decay, expert=expert, momentum_only=momentum_only)
    for start, stop, idx, offs in plan:
        group.buckets.append(Bucket(index, start, stop, [params[i] for i in idx], offs))
        for i, off in zip(idx, offs):
            p, n = params[i], params[i].numel()
            data[off:off + n].copy_(p.detach().reshape(-1))
            p.data = data[off:off + n].view_as(p)
            p.grad = grad[off:off + n].view_as(p) if keep_grads else None
    return group


class FlatParams:
    """Groups: matrices (weight decay) and vectors (norms, biases: no decay).

    `bucket_numel` (0: one bucket per group) and `multiple` (dp under ZeRO, else 1)
    shape the buckets; `keep_grads=False` leaves `.grad` unset (ZeRO-2 keeps only
    the reduced shard, see megaft.parallel.data.buckets). `dtype`: of params and grads
    (bf16 under optim.master_weights: the params are rounded into the buffers).
    `expert_multiple`: the bucket multiple of the expert groups (their replicas under ZeRO).
    `momentum_only`: params whose optimizer keeps one state buffer, in buffers of their own
    (decayed, split like the others by unit and expert; module docstring)."""

    def __init__(self, model: nn.Module, *, weight_decay: float, device: torch.device, bucket_numel: int = 0,
                 multiple: int = 1, keep_grads: bool = True, units: list[list[nn.Parameter]] | None = None,
                 dtype: torch.dtype = torch.float32, expert_multiple: int = 1, momentum_only=()):
        params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
        # ZeRO-3 passes `units` (a layer's params each): one buffer per unit and decay class,
        # so a layer's parameters can be gathered and freed on their own.
        split = [params] if units is None else units
        one = {id(p) for p in momentum_only}
        groups = []
        for ps in split:
            experts = [p for p in ps if expert_slice_of(p) is not None]
            dense = [p for p in ps if expert_slice_of(p) is None]
            decay = [p for p in dense if p.dim() >= 2 and id(p) not in one]
            no_decay = [p for p in dense if p.dim() < 2 and id(p) not in one]
            groups += [(g, wd, False, False) for g, wd in ((decay, weight_decay), (no_decay, 0.0)) if g]
            groups += [(g, weight_decay, False, True) for g in ([p for p in dense if id(p) in one],) if g]
            # stacked [E/ep, ...] matrices: decayed
            groups += [(g, weight_decay, True, m) for m in (False, True)
                       if (g := [p for p in experts if (id(p) in one) == m])]
        self.groups = [_flatten(i, ps, wd, device, cap=bucket_numel, multiple=expert_multiple if ex else multiple,
                                keep_grads=keep_grads, dtype=dtype, expert=ex, momentum_only=mo)
                       for i, (ps, wd, ex, mo) in enumerate(groups)]
        self._backward_rank = {id(p): i for i, p in enumerate(reversed(params))}
        # The model's persistent buffers (DeepSeek-V3's routing correction bias: state no optimizer
        # moves), by name, so checkpoints save and restore them with the parameters.
        self.buffers = {name: t for name, t in model.state_dict(keep_vars=True).items()
                        if not isinstance(t, nn.Parameter)}

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket, in the order backward is expected to make them ready (its
        earliest parameter in reverse model order), matrices and vectors interleaved."""
        buckets = [b for g in self.groups for b in g.buckets]
        return sorted(buckets, key=lambda b: min(self._backward_rank[id(p)] for p in b.params))

    def zero_grad(self) -> None:
        for g in self.groups:
            if g.grad is not None:
                g.grad.zero_()
