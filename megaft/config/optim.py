"""OptimConfig (`optim.*`): AdamW or Muon, warmup + cosine schedule, clipping, kernel choice."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

# the AdamW kernels (megaft.kernels.adamw, which reads this list): cpu is megaft._C, cuda megaft._cuda
FUSED_BACKENDS = ("auto", "torch", "cpu", "cuda", "triton")
Fused = StrEnum("Fused", [(b, b) for b in FUSED_BACKENDS])  # optim.fused's choices, checked by Hydra

Optimizer = StrEnum("Optimizer", [(n, n) for n in ("adamw", "muon")])  # optim.name's choices
NS_BACKENDS = ("torch", "triton", "auto")  # Muon's Newton-Schulz kernels (megaft.kernels.newton_schulz reads this)
NSBackend = StrEnum("NSBackend", [(n, n) for n in NS_BACKENDS])  # optim.muon.ns_backend's choices
# Muon's update scale (torch.optim.Muon's adjust_lr_fn): original sqrt(max(1, rows/cols)) (Keller
# Jordan's), match_rms_adamw 0.2*sqrt(max(rows, cols)) (Moonlight's: reuses AdamW's lr and decay)
MuonScale = StrEnum("MuonScale", [(n, n) for n in ("original", "match_rms_adamw")])


@dataclass
class MuonConfig:
    """optim.name=muon: the hidden 2-D weights' update (megaft.optim.muon; docs/optimizers.md)."""

    momentum: float = 0.95  # mu of the momentum buffer B <- mu B + (1 - mu) g (torch.optim.Muon's lerp)
    nesterov: bool = True  # orthogonalise (1 - mu) g + mu B instead of B
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_a: float = 3.4445  # the quintic's coefficients: X <- a X + (b A + c A^2) X, A = X X^T
    ns_b: float = -4.7750  # (Keller Jordan's, torch.optim.Muon's defaults)
    ns_c: float = 2.0315
    eps: float = 1e-7  # the update is divided by max(its Frobenius norm, eps) before Newton-Schulz
    scale: MuonScale = MuonScale.original  # the update's factor on lr: original | match_rms_adamw (Moonlight)
    weight_decay: Optional[float] = None  # decoupled; None: optim.weight_decay
    # the Newton-Schulz kernel (megaft.kernels.newton_schulz): torch (torch.optim.Muon's ops: bitwise equal to it),
    # triton (X X^T and b A + c A A^T as symmetric GEMMs, half the tiles; CUDA), auto (triton on CUDA, else torch)
    ns_backend: NSBackend = NSBackend.torch


@dataclass
class OptimConfig:
    name: Optimizer = Optimizer.adamw  # muon: Muon on hidden 2-D weights, AdamW on the rest
    lr: float = 3e-3  # peak learning rate, reached after warmup (the demo's: a tiny model from scratch)
    # floor of the cosine decay as a fraction of lr: 0.1, the demo's 3e-3 -> 3e-4 (and Llama's pretraining
    # decay to 10% of peak); the fine-tuning recipes set 0 (transformers' cosine decays to 0)
    min_lr_ratio: float = 0.1
    min_lr: Optional[float] = None  # the floor as an absolute rate; when set it wins over min_lr_ratio
    # linear warmup from lr/warmup to lr, in steps; set this or warmup_ratio (null the other; both null = none)
    warmup_steps: Optional[int] = 20
    warmup_ratio: Optional[float] = None  # the warmup as a fraction of train.max_steps, rounded up (transformers')
    weight_decay: float = 0.1  # decoupled; applied to matrices, not norms or biases
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    loss_scale: float = 65536.0  # precision=fp16: initial dynamic loss scale (halved on each inf/nan step)
    loss_scale_window: int = 1000  # precision=fp16: finite steps in a row before the scale doubles
    fused: Fused = Fused.auto  # AdamW kernel: auto | torch | cpu (megaft._C) | cuda (megaft._cuda) | triton
    # precision=bf16 only: bf16 params and grads in the model, fp32 master weights and moments in the
    # optimizer (the ZeRO paper's 2 + 2 + 12 bytes/param); false: the params are the fp32 masters (4 + 4 + 8)
    master_weights: bool = False
    muon: MuonConfig = field(default_factory=MuonConfig)


def check_optim(cfg: OptimConfig) -> list[str]:
    """Every problem of the values of ``cfg``; whether an explicit fused kernel can run on the
    run's device is megaft.optim.checks.check_fused's question."""
    errors = []
    if cfg.lr <= 0:
        errors.append(f"optim.lr={cfg.lr} must be > 0")
    elif cfg.min_lr is not None and not 0 <= cfg.min_lr <= cfg.lr:
        errors.append(f"optim.lr={cfg.lr}, optim.min_lr={cfg.min_lr}: need 0 <= min_lr <= lr; fix: optim.min_lr=null "
                      f"(the floor is then optim.min_lr_ratio * lr = {cfg.min_lr_ratio} * lr) or a min_lr below lr")
    if not 0 <= cfg.min_lr_ratio <= 1:
        errors.append(f"optim.min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1] (the cosine floor as a fraction of "
                      "optim.lr); fix: e.g. 0.1, or 0 to decay to zero")
    return errors + check_warmup(cfg) + check_betas_and_rest(cfg)


def check_warmup(cfg: OptimConfig) -> list[str]:
    """optim.warmup_steps and optim.warmup_ratio: one at most (as axolotl and litgpt refuse both)."""
    if cfg.warmup_steps is not None and cfg.warmup_ratio is not None:
        return [f"optim.warmup_steps={cfg.warmup_steps} and optim.warmup_ratio={cfg.warmup_ratio} are both set, and "
                "one would be ignored; fix: null one of them (optim.warmup_steps=null to warm up over a fraction "
                "of the run, optim.warmup_ratio=null for a step count)"]
    if cfg.warmup_steps is not None and cfg.warmup_steps < 0:
        return [f"optim.warmup_steps={cfg.warmup_steps} must be >= 0"]
    if cfg.warmup_ratio is not None and not 0 <= cfg.warmup_ratio <= 1:
        return [f"optim.warmup_ratio={cfg.warmup_ratio} must be in [0, 1] (a fraction of train.max_steps); "
                "fix: e.g. 0.03"]
    return []


def check_betas_and_rest(cfg: OptimConfig) -> list[str]:
    """Adam's betas, clipping, fp16 loss scaling and the kernel choice."""
    errors = []
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        errors.append(f"optim.beta1={cfg.beta1}, optim.beta2={cfg.beta2} must be in [0, 1)")
    if cfg.clip_grad < 0:
        errors.append(f"optim.clip_grad={cfg.clip_grad} must be >= 0 (0 disables clipping)")
    if cfg.loss_scale <= 0 or cfg.loss_scale_window < 1:
        errors.append(f"optim.loss_scale={cfg.loss_scale}, optim.loss_scale_window={cfg.loss_scale_window}: need "
                      "loss_scale > 0 and loss_scale_window >= 1; fix: e.g. 65536 and 1000")
    if cfg.fused not in FUSED_BACKENDS:
        errors.append(f"optim.fused={cfg.fused!r} is unknown; fix: one of {', '.join(FUSED_BACKENDS)}")
    return errors + check_muon(cfg)


def floor_lr(cfg: OptimConfig) -> float:
    """The cosine decay's floor: optim.min_lr when set, else optim.min_lr_ratio * optim.lr."""
    return cfg.min_lr if cfg.min_lr is not None else cfg.lr * cfg.min_lr_ratio


def warmup_steps(cfg: OptimConfig, max_steps: int) -> int:
    """The warmup's length in steps: optim.warmup_steps, else ceil(optim.warmup_ratio * max_steps) (transformers'
    TrainingArguments.get_warmup_steps), else 0."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    return math.ceil(max_steps * cfg.warmup_ratio) if cfg.warmup_ratio is not None else 0


DEMO_LR = OptimConfig.lr  # the demo's peak rate (conf/recipe/demo.yaml keeps it)


def recipe_names(conf: str) -> list[str]:
    """The recipes of conf/recipe/ other than the demo, sorted (`conf`: the config tree's directory)."""
    folder = os.path.join(conf, "recipe")
    names = [f[:-len(".yaml")] for f in os.listdir(folder) if f.endswith(".yaml")] if os.path.isdir(folder) else []
    return sorted(n for n in names if n != "demo")


def pretrained_lr_warning(cfg: OptimConfig, *, init_from: Optional[str], conf: str) -> Optional[str]:
    """The warning of a run that loads pretrained weights at the demo's learning rate, else None."""
    if not init_from or cfg.lr != DEMO_LR:
        return None
    names = " | ".join(recipe_names(conf))
    return (f"optim.lr={cfg.lr} is the demo's learning rate (a tiny model trained from scratch) and model.init_from "
            "loads pretrained weights, which it would wreck: fine-tunes use 1e-5 to 2e-5 (full) or 1e-4 to 2e-4 "
            f"(LoRA); fix: pick a recipe (recipe={names}: conf/recipe/, docs/getting-started.md) or set optim.lr")


def check_muon(cfg: OptimConfig) -> list[str]:
    """optim.name and optim.muon.*'s values (the layouts Muon runs under: megaft.optim.muon)."""
    mu, errors = cfg.muon, []
    if cfg.name not in set(Optimizer):
        errors.append(f"optim.name={cfg.name!r} is unknown; fix: adamw or muon")
    if not 0 <= mu.momentum < 1 or not 1 <= mu.ns_steps < 100 or mu.eps <= 0:
        errors.append(f"optim.muon: momentum={mu.momentum}, ns_steps={mu.ns_steps}, eps={mu.eps}: need "
                      "0 <= momentum < 1, 1 <= ns_steps < 100 and eps > 0; fix: e.g. 0.95, 5 and 1e-7")
    if mu.scale not in set(MuonScale):
        errors.append(f"optim.muon.scale={mu.scale!r} is unknown; fix: original or match_rms_adamw")
    if mu.ns_backend not in NS_BACKENDS:
        errors.append(f"optim.muon.ns_backend={mu.ns_backend!r} is unknown; fix: one of {', '.join(NS_BACKENDS)}")
    if mu.weight_decay is not None and mu.weight_decay < 0:
        errors.append(f"optim.muon.weight_decay={mu.weight_decay} must be >= 0 (or null: optim.weight_decay)")
    return errors


def check_master_weights(cfg: OptimConfig, *, precision: str) -> list[str]:
    """optim.master_weights=true: needs precision=bf16; any tp/pp/dp, zero 0-3, offload and
    grad_compression (bf16 buckets are reduced in fp32, PowerSGD included: megaft.parallel.data.buckets)."""
    if not cfg.master_weights:
        return []
    errors = []
    if precision != "bf16":  # the AdamW kernels take fp32 or bf16 params (no fp16 path, no loss scaling)
        errors.append(f"optim.master_weights=true needs precision=bf16 (got precision={precision}): the model "
                      "holds bf16 params and grads; fix: precision=bf16, or optim.master_weights=false")
    return errors
