"""LoRA on a mixture of experts: per-expert adapters on the stacked expert weights, and the router's.

`lora.targets` `experts`: each routed expert e gets its own pair on each of its gate, up and
down projections. For a stacked weight W [E, out, in] the adapter is A [E, r, in],
B [E, out, r] and, for the rows routed to e, y = W_e x + s B_e A_e x. The two low-rank GEMMs
are grouped GEMMs over the same sorted rows and counts as the weight's own
(megaft.models.moe.layer.Experts calls `ExpertLora.project`), so each row's result depends on its row
and its expert alone, as without adapters: every layout equals the single process.

Splits follow the expert weight's (megaft.peft.lora's rule for the dense linears):

* tp: gate/up are column-parallel, A [E, r, dim] replicated (its gradient, partial per tp rank,
  summed over tp like a sequence-parallel parameter's) and B [E, F/tp, r] split by rows; down is
  row-parallel, A [E, r, F/tp] split by columns and B [E, dim, r] replicated (partial A x summed
  by the MoE layer's own reduction, B's gradient summed over tp).
* ep: each ep rank holds its experts' adapters [E/ep, ...], marked with the weight's ExpertSlice,
  so gradient reduction (expert replica group), ZeRO, the grad norm, checkpoints (resharded by
  expert index) and export treat them as expert weights.

Init does not depend on tp or ep: each expert's A_e is drawn whole from a generator seeded by
(seed, parameter name, expert index) and sliced; B = 0.

`router`: `RouterAdapter` on the router weight [E, dim]: logits = x (W + s B A)^T in fp32,
A [r, dim], B [E, r], replicated like the router (sequence-parallel marked under sequence
parallel, as the router weight is).

Parameter names: `<...>.mlp.experts.adapter.<gate_proj|up_proj|down_proj>.A` / `.B`
and `<...>.mlp.gate.adapter.A` / `.B`.
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.lora import LoraConfig, LoraInit
from megaft.kernels.grouped_gemm import grouped_mm
from megaft.models.moe.layer import Experts
from megaft.models.moe.router import Router
from megaft.parallel.tensor.shard import (
    expert_slice_of,
    full_shape,
    is_sequence_parallel,
    local_from_full,
    mark_expert_slice,
    mark_sequence_parallel,
    mark_sharded,
    shard_of,
)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def seed_for(seed: int, name: str) -> int:
    """The generator seed of adapter `name` (a parameter name, `:e` appended per expert)."""
    digest = hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ExpertPair(nn.Module):
    """A [E_local, r, in], B [E_local, out, r] of one stacked projection, split like `weight`."""

    def __init__(self, weight: nn.Parameter, rank: int, *, row: bool):
        super().__init__()
        e, out, inp = weight.shape
        spec, split = shard_of(weight), expert_slice_of(weight)
        if row:  # down: A split by columns like the weight, B replicated (grad summed over tp)
            self.A = mark_sharded(nn.Parameter(weight.new_zeros(e, rank, inp, dtype=torch.float32)), 2,
                                  spec.full, spec.padded)
            self.B = mark_sequence_parallel(nn.Parameter(weight.new_zeros(e, out, rank, dtype=torch.float32)))
        else:  # gate/up: A replicated (grad summed over tp), B split by rows like the weight
            self.A = mark_sequence_parallel(nn.Parameter(weight.new_zeros(e, rank, inp, dtype=torch.float32)))
            self.B = mark_sharded(nn.Parameter(weight.new_zeros(e, out, rank, dtype=torch.float32)), 1,
                                  spec.full, spec.padded)
        if split is not None:  # this ep rank's experts only, as the weight
            for p in (self.A, self.B):
                mark_expert_slice(p, split.rank, split.size, split.experts, split.group)

    @torch.no_grad()
    def delta(self, scale: float) -> torch.Tensor:
        """s B_e A_e for each local expert: shaped like the local stacked weight (fp32)."""
        return torch.bmm(self.B.float(), self.A.float()) * scale


class ExpertLora(nn.Module):
    """The per-expert adapters of one `Experts` module (its `adapter`)."""

    def __init__(self, experts: Experts, cfg: LoraConfig):
        super().__init__()
        self.scale = cfg.scale
        for name in PROJECTIONS:
            setattr(self, name, ExpertPair(getattr(experts, name), cfg.rank, row=name == "down_proj"))

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
        """s B_e A_e x for rows `x` sorted by local expert (`counts` rows each), through the
        grouped GEMM the weight itself uses."""
        pair: ExpertPair = getattr(self, name)
        a, b = pair.A, pair.B
        if x.dtype != a.dtype:  # autocast: the grouped kernels take one dtype
            a, b = a.to(x.dtype), b.to(x.dtype)
        return grouped_mm(grouped_mm(x, a, counts, backend=backend), b, counts, backend=backend) * self.scale


class RouterAdapter(nn.Module):
    """s B A x on the router's input, added to its fp32 logits (megaft.models.moe.router.Router).
    Named and exported like a dense adapter (megaft.peft.lora.adapters yields it)."""

    def __init__(self, router: Router, cfg: LoraConfig, *, sequence_parallel: bool):
        super().__init__()
        self.scale = cfg.scale
        experts, dim = router.weight.shape
        self.A = nn.Parameter(router.weight.new_zeros(cfg.rank, dim, dtype=torch.float32))
        self.B = nn.Parameter(router.weight.new_zeros(experts, cfg.rank, dtype=torch.float32))
        if sequence_parallel:  # applied to sequence shards, as the router weight: grads summed over tp
            mark_sequence_parallel(self.A)
            mark_sequence_parallel(self.B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x.float(), self.A.float()), self.B.float()) * self.scale

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        return (self.B.float() @ self.A.float()) * self.scale


def expert_adapters(model: nn.Module) -> Iterator[tuple[str, ExpertLora]]:
    """(Experts module name, its ExpertLora) of every adapted expert set in `model`."""
    for name, module in model.named_modules():
        if isinstance(module, ExpertLora):
            yield name.removesuffix(".adapter"), module


def expert_adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, a in expert_adapters(model) for name in PROJECTIONS for p in (getattr(a, name).A,
                                                                                  getattr(a, name).B)]


def attach_moe_adapters(model: nn.Module, cfg: LoraConfig) -> None:
    """Per-expert adapters on every `Experts` (target `experts`) and an adapter on every
    `Router` (target `router`) of `model` (a pipeline stage's: those it holds)."""
    for module in list(model.modules()):
        if isinstance(module, Experts) and "experts" in cfg.targets:
            module.adapter = ExpertLora(module, cfg)
        elif isinstance(module, Router) and "router" in cfg.targets:
            # split like the router weight: sequence-parallel marked when it is
            module.adapter = RouterAdapter(module, cfg, sequence_parallel=is_sequence_parallel(module.weight))


@torch.no_grad()
def init_expert_adapters(model: nn.Module, cfg: LoraConfig, *, seed: int, tp_rank: int, tp_size: int) -> None:
    """Each expert's A_e drawn whole from a generator seeded by (seed, name, e), then this rank's
    experts and tp slice kept: the same adapters at any tp and ep. B stays zero."""
    for module_name, adapter in expert_adapters(model):
        for proj in PROJECTIONS:
            param = getattr(adapter, proj).A
            name = f"{module_name}.adapter.{proj}.A"
            shape = full_shape(param, tp_size)
            split = expert_slice_of(param)
            lo, hi = split.bounds if split is not None else (0, shape[0])
            full = torch.zeros(shape)
            for e in range(lo, hi):  # only this rank's experts are drawn
                gen = torch.Generator().manual_seed(seed_for(seed, f"{name}:{e}"))
                if cfg.init == LoraInit.gaussian:
                    full[e] = torch.randn(shape[1:], generator=gen) / cfg.rank
                else:  # kaiming_uniform_(a=sqrt(5)) as peft: bound = 1 / sqrt(fan_in)
                    full[e] = (torch.rand(shape[1:], generator=gen) * 2 - 1) / math.sqrt(shape[2])
            param.copy_(local_from_full(full, param, tp_rank, tp_size).to(param.device))


def merged_expert_weight(model: nn.Module, name: str, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's piece of stacked expert weight `name`) with each expert's s B_e A_e
    added (fp32), or unchanged when `name` is no adapted expert weight."""
    module_name, _, proj = name.rpartition(".")
    if proj not in PROJECTIONS:
        return local
    try:
        adapter = model.get_submodule(module_name + ".adapter")
    except AttributeError:
        return local
    if not isinstance(adapter, ExpertLora):
        return local
    return local.float() + getattr(adapter, proj).delta(adapter.scale)

