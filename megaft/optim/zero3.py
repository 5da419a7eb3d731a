"""ZeRO stage 3: parameters sharded over dp, each layer gathered only while it runs.

A "unit" is one top-level layer of the model (the embedding, every decoder block,
the final norm, the head). FlatParams gives every unit its own buffers (one per
decay class, one bucket each), so a unit's full parameters can be materialized
and freed on their own: the buffer's storage is resized to zero when free and
back (then all-gathered from the dp owners' chunks) when needed. Parameter and
saved-activation views keep pointing at the storage, so they are valid again
after the gather (the FSDP1 mechanism).

Gathered: before a unit's forward (forward pre-hook) and again before its
backward (a hook on its outputs' gradient, since forward freed it); freed: after its
forward and once every parameter of the unit has its gradient (post-accumulate
hook). A parameter shared by two units (a tied embedding) is counted per use.
While a unit runs, the next one's gather is already in flight (async all-gather:
the next in forward, the previous in backward).

Under pipeline parallelism the same hooks fire inside every F and B action of the
runtime: each stage gathers its own layers over its dp group, before each micro-batch's
forward and again before its backward. dp ranks of one pp rank run the same action
list, so their gathers are issued in the same order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megaft.parallel.comm import Group, all_gather_single, group_size
from megaft.parallel.data.flat import FlatParams


def model_units(model: nn.Module) -> list[nn.Module]:
    """The top-level layers holding parameters, in forward order (ModuleLists and ModuleDicts
    expanded: a pipeline StageModel keeps its layers in a ModuleDict and calls them one by one).
    A model that calls its parts' layers itself (a vision-language model: the language model's
    embedding, its own tower, then the language model's blocks) names them in `zero3_units()`."""
    if hasattr(model, "zero3_units"):
        return [m for m in model.zero3_units() if any(True for _ in m.parameters())]
    units = []
    for child in model.children():
        if isinstance(child, nn.ModuleList):
            kids = list(child)
        elif isinstance(child, nn.ModuleDict):
            kids = list(child.values())
        else:
            kids = [child]
        units += [m for m in kids if any(True for _ in m.parameters())]
    return units


def unit_params(units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Each unit's trainable params, a shared (tied) one only in its first unit."""
    seen, out = set(), []
    for m in units:
        ps = [p for p in m.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in ps)
        out.append(ps)
    return out


class ParamGatherer:
    """Materializes units' parameters from the dp-sharded chunks on demand (see module doc).

    `shards[i]` is this rank's chunk of bucket i (the optimizer's master copy)."""

    def __init__(self, flat: FlatParams, units: list[nn.Module], shards: list[torch.Tensor], dp_group: Group,
                 expert_group: Group = None):
        self.flat, self.units = flat, units
        # each buffer's owners: routed experts split over ep are sharded over their replicas
        self.groups = [expert_group if g.expert else dp_group for g in flat.groups]
        buckets = flat.buckets
        self.shard_of = {b.group: s for b, s in zip(buckets, shards)}  # one bucket per group under ZeRO-3
        group_of = {id(p): g_i for g_i, g in enumerate(flat.groups) for p in g.params}
        self.unit_groups = [sorted({group_of[id(p)] for p in m.parameters() if id(p) in group_of}) for m in units]
        self.unit_param_ids = [{id(p) for p in m.parameters() if p.requires_grad} for m in units]
        self.refs = [0] * len(flat.groups)
        self._inflight: dict[int, dist.Work] = {}  # prefetched groups: gathering, not yet acquired
        self._waiting: list[set[int]] = [set() for _ in units]  # params still to get a grad, per unit
        self._hooks = []
        for i, m in enumerate(units):
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, i=i: self._before_forward(i)))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, i=i: self._after_forward(i, out)))
        owners: dict[int, list[int]] = {}
        for i, ids in enumerate(self.unit_param_ids):
            for pid in ids:
                owners.setdefault(pid, []).append(i)
        for p in flat.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, units=tuple(owners.get(id(p), ())): self._grad_ready(p, units)))
        for gi in range(len(flat.groups)):
            self._free(gi)

    def _free(self, gi: int) -> None:
        self.flat.groups[gi].data.untyped_storage().resize_(0)

    @torch.no_grad()
    def _gather(self, gi: int) -> None:
        data = self.flat.groups[gi].data
        data.untyped_storage().resize_(data.numel() * data.element_size())
        shard, group = self.shard_of[gi], self.groups[gi]
        if group_size(group) == 1:
            data.copy_(shard)
        else:
            self._inflight[gi] = all_gather_single(data, shard, group=group, async_op=True)

    def acquire(self, i: int) -> None:
        for gi in self.unit_groups[i]:
            if self.refs[gi] == 0 and gi not in self._inflight:
                self._gather(gi)
            if gi in self._inflight:
                self._inflight.pop(gi).wait()
            self.refs[gi] += 1

    def prefetch(self, i: int) -> None:
        """Start gathering unit i (the next one to run) while the current one computes."""
        if 0 <= i < len(self.units):
            for gi in self.unit_groups[i]:
                if self.refs[gi] == 0 and gi not in self._inflight:
                    self._gather(gi)

    def release(self, i: int) -> None:
        for gi in self.unit_groups[i]:
            self.refs[gi] -= 1
            if self.refs[gi] == 0:
                self._free(gi)

    def acquire_all(self) -> None:
        """Gather every unit (collective, same order on all ranks): evaluation and generation
        run unequal numbers of forwards per dp rank, so they must not gather per layer."""
        for i in range(len(self.units)):
            self.acquire(i)

    def release_all(self) -> None:
        for i in range(len(self.units)):
            self.release(i)

    def _before_forward(self, i: int) -> None:
        self.acquire(i)
        if torch.is_grad_enabled():  # training runs every unit in order (evaluation holds them all)
            self.prefetch(i + 1)

    def _after_forward(self, i: int, out) -> None:
        self.release(i)
        if not torch.is_grad_enabled():
            return
        # The first gradient to reach one of the outputs comes before the unit's own
        # backward: gather there (a tensor hook, not a module backward hook, which torch
        # warns about when no input needs grad, as for the embedding).
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor) and t.requires_grad]
        fired = [False]

        def on_grad(grad):
            if not fired[0]:
                fired[0] = True
                self._before_backward(i)

        for t in outs:
            t.register_hook(on_grad)

    def _before_backward(self, i: int) -> None:
        if self._waiting[i]:  # the previous backward left a param without grad: close it first
            self._waiting[i].clear()
            self.release(i)
        self.acquire(i)
        self.prefetch(i - 1)  # backward runs the units in reverse
        self._waiting[i] = set(self.unit_param_ids[i])

    def _grad_ready(self, p: nn.Parameter, units: tuple[int, ...]) -> None:
        for i in units:
            waiting = self._waiting[i]
            if id(p) in waiting:
                waiting.discard(id(p))
                if not waiting:
                    self.release(i)

    def end_backward(self) -> None:
        """Release units whose backward left a parameter without a gradient (unused ones),
        and drop prefetches that no unit took."""
        for i, waiting in enumerate(self._waiting):
            if waiting:
                waiting.clear()
                self.release(i)
        for gi, work in list(self._inflight.items()):
            work.wait()
            if self.refs[gi] == 0:
                self._free(gi)
        self._inflight.clear()

    def held_bytes(self) -> int:
        """Bytes of full parameters materialized right now (0 between steps)."""
        return sum(g.data.untyped_storage().nbytes() for g in self.flat.groups)
