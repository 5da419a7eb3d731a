"""A mixture of experts' adapters in peft's form for transformers 5 (peft >= 0.17 `target_parameters`).

transformers 5 holds each MoE block's routed experts fused in memory: `mlp.experts.gate_up_proj`
[E, 2F, dim] (gate rows first) and `mlp.experts.down_proj` [E, dim, F], and the router as a module
with a bare `weight` (`mlp.gate.weight`). peft adapts such parameters through
`LoraConfig(target_parameters=[...])` (peft.tuners.lora.layer.ParamWrapper): for a 3-D parameter
[E, out, in] of rank R it holds lora_A [E R, in] and lora_B [out, E R], expert e's pair being
A_e = lora_A[e R:(e+1) R] and B_e[:, j] = lora_B[:, j E + e] (its get_delta_weight: W_e + s B_e A_e).
So per-expert adapters are expressed exactly:

* down_proj: A [E, r, F] -> lora_A = A.reshape(E r, F); B [E, dim, r] -> lora_B = B.permute(1, 2, 0)
  .reshape(dim, r E).
* gate_up_proj: the gate and up adapters fused as peft's own v4 -> v5 conversion fuses them
  (peft.utils.transformers_weight_conversion.PeftConcatenate): A_e = [A_gate_e; A_up_e] (rank 2r),
  B_e = blockdiag(B_gate_e, B_up_e), with `rank_pattern` 2r and `alpha_pattern` keeping s (2 alpha;
  sqrt(2) alpha under rsLoRA).

Two parameters of one module are nested wrappers in the order the module declares them:
gate_up_proj inside (`mlp.experts.base_layer.lora_A.weight`), down_proj outside
(`mlp.experts.lora_A.weight`). The router's adapter is `mlp.gate.lora_A.weight` [r, dim],
`lora_B` [E, r]. In a MoE model the dense MLPs' and shared experts' gate/up/down go in
`target_parameters` by their weights (`mlp.gate_proj.weight`, `mlp.shared_expert.gate_proj.weight`):
for qwen3_moe, olmoe, deepseek_v3 peft rewrites `target_modules` entries named gate_proj/up_proj/
down_proj into the fused experts' (transformers 4 adapters), which would leave those MLPs unadapted.
"""
from __future__ import annotations

import math

import torch

from megaft.config.lora import LoraConfig
from megaft.models.hf.export import gather_full
from megaft.parallel.comm import Group
from megaft.peft.experts import ExpertLora

PREFIX = "base_model.model."
MLP_LEAVES = ("gate_proj", "up_proj", "down_proj")


def router_name(module: str, which: str) -> str:
    """peft's name of a router adapter tensor: transformers 5's in-memory `model.layers.N.mlp.gate`."""
    return f"{PREFIX}model.{module}.lora_{which}.weight"


def _flat_a(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(-1, a.shape[-1])  # [E, R, in] -> [E R, in], expert-major


def _flat_b(b: torch.Tensor) -> torch.Tensor:
    return b.permute(1, 2, 0).reshape(b.shape[1], -1)  # [E, out, R] -> [out, R E], column j E + e


@torch.no_grad()
def expert_tensors(module: str, adapter: ExpertLora, tp_group: Group) -> dict[str, torch.Tensor]:
    """peft's tensors of one Experts module's adapters (`module`: our name, `layers.N.mlp.experts`),
    whole: gathered over tp and ep (collective)."""
    full = {f"{proj}.{w}": gather_full(getattr(getattr(adapter, proj), w), tp_group).float().cpu()
            for proj in MLP_LEAVES for w in ("A", "B")}
    a_gate_up = torch.cat([full["gate_proj.A"], full["up_proj.A"]], dim=1)
    bg, bu = full["gate_proj.B"], full["up_proj.B"]
    b_gate_up = bg.new_zeros(bg.shape[0], bg.shape[1] + bu.shape[1], bg.shape[2] + bu.shape[2])
    b_gate_up[:, :bg.shape[1], :bg.shape[2]] = bg
    b_gate_up[:, bg.shape[1]:, bg.shape[2]:] = bu
    base = f"{PREFIX}model.{module}"
    return {f"{base}.base_layer.lora_A.weight": _flat_a(a_gate_up).contiguous(),
            f"{base}.base_layer.lora_B.weight": _flat_b(b_gate_up).contiguous(),
            f"{base}.lora_A.weight": _flat_a(full["down_proj.A"]).contiguous(),
            f"{base}.lora_B.weight": _flat_b(full["down_proj.B"]).contiguous()}


def moe_targets(tensors: dict[str, torch.Tensor], cfg: LoraConfig) -> tuple[list[str], dict, dict]:
    """(target_parameters, rank_pattern, alpha_pattern) of a MoE model's exported `tensors`."""
    params, rank_pattern, alpha_pattern = set(), {}, {}
    for name in tensors:
        module = name.removeprefix(PREFIX).rpartition(".lora_")[0]
        parts = module.split(".")
        if parts[-1] == "experts" or parts[-2:] == ["experts", "base_layer"]:
            params.update(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
            rank_pattern["gate_up_proj"] = 2 * cfg.rank  # gate and up fused: rank 2r, scale kept
            alpha_pattern["gate_up_proj"] = cfg.alpha * (math.sqrt(2) if cfg.rslora else 2)
        elif parts[-2:] == ["mlp", "gate"]:
            params.add("mlp.gate.weight")
        elif parts[-1] in MLP_LEAVES:  # a dense MLP's or a shared expert's linear, by its parent's name
            params.add(f"{parts[-2]}.{parts[-1]}.weight")
    return sorted(params), rank_pattern, alpha_pattern
