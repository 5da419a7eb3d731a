"""LoRA adapters on the tensor-parallel linears (Hu et al. 2021): y = W x + s * B A drop(x).

Each targeted ColumnParallelLinear / RowParallelLinear gets an `adapter` submodule
(megaft.layers.linear calls it on the layer's local input and adds its output to the
local GEMM's, before any reduction). The shapes follow the weight's split:

* column-parallel (q, k, v, gate, up, lm_head): A [r, in] replicated, B [out/tp, r]
  split by output like the weight. Each rank's B slice sees all of A, so A's gradient
  is a partial sum per rank: it is marked like a sequence-parallel parameter and summed
  over tp after backward (megaft.parallel.tensor.grads), then counted once in the grad norm.
* row-parallel (o, down): A [r, in/tp] split by input like the weight, B [out, r]
  replicated. A's slice gives a partial A x; since B is replicated, B (sum A x) =
  sum (B A x), so each rank adds B (its partial A x) to its partial GEMM output and the
  layer's own all-reduce (or, with sequence parallel, reduce-scatter) sums both at once.
  B's gradient is then partial per rank and summed over tp like column A's.

Dropout masks are drawn for the WHOLE input and a row adapter keeps its slice
(megaft.layers.dropout), so the same RNG stream (every tp rank of a replica shares it)
gives the same masks at any tp, the single process included. Init is tp-independent as
well: each full A is drawn from a generator seeded by (seed, parameter name) and sliced
(megaft.models.init's rule).

Parameter names: `<linear>.adapter.A` / `.B` (peft's lora_A / lora_B: megaft.peft.export).
The base parameters are frozen (requires_grad=False): FlatParams, the dp buckets, the
grad norm and the optimizer see only the adapters (megaft.parallel.data.flat takes trainable
parameters only), so checkpoints hold the adapters and their AdamW state.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.lora import TARGET_MODULES, BaseDtype, LoraConfig, LoraInit, check_lora_model, check_lora_moe
from megaft.layers import ColumnParallelLinear, RowParallelLinear
from megaft.layers.dropout import sliced_dropout
from megaft.parallel.comm import Group, group_rank, group_size
from megaft.parallel.tensor.shard import full_shape, local_from_full, mark_sequence_parallel, mark_sharded, shard_of
from megaft.peft.experts import (
    RouterAdapter,
    attach_moe_adapters,
    expert_adapter_parameters,
    init_expert_adapters,
    merged_expert_weight,
    seed_for,
)

SHARED_EXPERTS = ("shared_expert", "shared_experts")  # Qwen2-MoE's and DeepSeek-V3's MLP names in a MoE block


class LoraAdapter(nn.Module):
    """s * B A drop(x) on a linear's local input; see the module docstring for the splits.
    `row`: the linear is row-parallel (x is its tp slice of the input features)."""

    def __init__(self, linear: ColumnParallelLinear | RowParallelLinear, cfg: LoraConfig, *, group: Group):
        super().__init__()
        self.row, self.p, self.scale = isinstance(linear, RowParallelLinear), cfg.dropout, cfg.scale
        tp, r = group_size(group), cfg.rank
        device = linear.weight.device
        if self.row:  # A split by input like the weight, B replicated (grad summed over tp)
            self.A = mark_sharded(nn.Parameter(torch.zeros(r, linear.in_features // tp, device=device)), 1,
                                  linear.in_features, linear.in_features)
            self.B = mark_sequence_parallel(nn.Parameter(torch.zeros(linear.out_features, r, device=device)))
        else:  # A replicated (grad summed over tp), B split by output like the weight (padding included)
            spec = shard_of(linear.weight)
            self.A = mark_sequence_parallel(nn.Parameter(torch.zeros(r, linear.in_features, device=device)))
            self.B = mark_sharded(nn.Parameter(torch.zeros(linear.weight.shape[0], r, device=device)), 0,
                                  spec.full, spec.padded)
        self.in_full, self.in_start = linear.in_features, (group_rank(group) * self.A.shape[1] if self.row else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.p > 0:
            x = sliced_dropout(x, self.p, dim=-1, size=self.in_full, start=self.in_start)
        return F.linear(F.linear(x, self.A), self.B) * self.scale

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """s * B A: this rank's piece of the weight update, shaped like the local weight (fp32)."""
        return (self.B.float() @ self.A.float()) * self.scale


def target_linears(model: nn.Module, targets: list[str]) -> Iterator[tuple[str, nn.Module]]:
    """(module name, linear) of every targeted linear in `model`, in model order. gate/up/down
    are the dense MLPs'; a MoE block's shared expert(s) take target `shared_expert`."""
    wanted = {TARGET_MODULES[t] for t in targets if t in TARGET_MODULES}
    shared = {"gate_proj", "up_proj", "down_proj"} if "shared_expert" in targets else set()
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        parent, _, leaf = name.rpartition(".")
        if leaf in (shared if parent.rpartition(".")[2] in SHARED_EXPERTS else wanted):
            yield name, module


def adapters(model: nn.Module) -> Iterator[tuple[str, LoraAdapter | RouterAdapter]]:
    """(adapted module's name, adapter) of every linear's and router's adapter in `model`
    (the experts': megaft.peft.experts.expert_adapters)."""
    for name, module in model.named_modules():
        if isinstance(module, (LoraAdapter, RouterAdapter)):
            yield name.removesuffix(".adapter"), module


@torch.no_grad()
def init_adapters(model: nn.Module, cfg: LoraConfig, *, seed: int, tp_rank: int, tp_size: int) -> None:
    """A drawn whole from a generator seeded by (seed, name) and sliced (so any tp starts from
    the same adapters); B zeros, so the adapted model starts as the base model."""
    for name, param in model.named_parameters():
        if not name.endswith(".adapter.A"):
            continue
        shape = full_shape(param, tp_size)
        gen = torch.Generator().manual_seed(seed_for(seed, name))
        if cfg.init == LoraInit.gaussian:
            full = torch.randn(shape, generator=gen) / cfg.rank
        else:  # kaiming_uniform_(a=sqrt(5)) as nn.Linear and peft: bound = 1 / sqrt(fan_in)
            bound = 1.0 / math.sqrt(shape[1])
            full = (torch.rand(shape, generator=gen) * 2 - 1) * bound
        param.copy_(local_from_full(full, param, tp_rank, tp_size).to(param.device))


def _check_targets(model: nn.Module, cfg: LoraConfig, tp_size: int) -> None:
    """validate()'s model-dependent LoRA checks (megaft.config.lora.check_lora_model), repeated
    for callers that build a model without validating a Config."""
    model_cfg = getattr(model, "cfg", None)
    if model_cfg is None:  # a bare module: no architecture to check against
        return
    problems = check_lora_model(cfg, tie_embeddings=model_cfg.tie_embeddings, kv_heads=model_cfg.kv_heads,
                                tp=tp_size, mla=model_cfg.mla, q_latent=model_cfg.q_lora_rank is not None)
    problems += check_lora_moe(cfg, n_experts=model_cfg.n_experts,
                               shared_expert=bool(model_cfg.shared_expert_ffn_dim))
    if problems:
        raise ValueError("; ".join(problems))


def apply_lora(model: nn.Module, cfg: LoraConfig, *, seed: int, tp_rank: int, tp_size: int,
               group: Group = None) -> nn.Module:
    """Freeze every base parameter of `model` (its weights loaded or initialized), optionally
    store the base linears in bf16 (`lora.base_dtype`), and attach seeded adapters to the
    targeted linears (those this rank holds: a pipeline stage's). Returns `model`."""
    group = getattr(model, "group", None) if group is None else group
    for p in model.parameters():
        p.requires_grad_(False)
    found = list(target_linears(model, list(cfg.targets)))
    _check_targets(model, cfg, tp_size)
    if cfg.base_dtype == BaseDtype.bf16:
        to_bf16(model)
    for _, linear in found:
        linear.adapter = LoraAdapter(linear, cfg, group=group)
    attach_moe_adapters(model, cfg)
    init_adapters(model, cfg, seed=seed, tp_rank=tp_rank, tp_size=tp_size)
    init_expert_adapters(model, cfg, seed=seed, tp_rank=tp_rank, tp_size=tp_size)
    return model


def to_bf16(model: nn.Module) -> None:
    """Store the frozen base linears' weights (and biases) in bf16. The embedding and norms stay
    fp32 (the residual stream keeps the full fine-tune's fp32); a head tied to the embedding too."""
    embed = getattr(getattr(model, "embed_tokens", None), "weight", None)
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            for p in (module.weight, module.bias):
                if p is not None and p is not embed:
                    p.data = p.data.to(torch.bfloat16)


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, a in adapters(model) for p in (a.A, a.B)] + expert_adapter_parameters(model)


def merged_weight(model: nn.Module, name: str, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's piece of parameter `name`) with its adapter's s * B A added (fp32),
    or unchanged when `name` is no adapted linear's weight: megaft.peft.export's merge."""
    if not name.endswith(".weight"):  # a stacked expert weight (`...mlp.experts.gate_proj`) or none
        return merged_expert_weight(model, name, local)
    module = _get(model, name.removesuffix(".weight"))
    adapter: Optional[LoraAdapter] = getattr(module, "adapter", None)
    if not isinstance(adapter, (LoraAdapter, RouterAdapter)):
        return local
    return local.float() + adapter.delta()


def _get(model: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
