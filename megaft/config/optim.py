"""OptimConfig (`optim.*`): AdamW, warmup + cosine schedule, clipping, kernel choice."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# the AdamW kernels (megaft.kernels.adamw, which reads this list): cpu is megaft._C, cuda megaft._cuda
FUSED_BACKENDS = ("auto", "torch", "cpu", "cuda", "triton")
Fused = StrEnum("Fused", [(b, b) for b in FUSED_BACKENDS])  # optim.fused's choices, checked by Hydra


@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak learning rate, reached after warmup
    min_lr: float = 3e-4  # floor of the cosine decay
    warmup_steps: int = 20  # linear warmup from lr/warmup_steps to lr
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


def check_optim(cfg: OptimConfig) -> list[str]:
    """Every problem of the values of ``cfg``; whether an explicit fused kernel can run on the
    run's device is megaft.optim.checks.check_fused's question."""
    errors = []
    if cfg.lr <= 0 or cfg.min_lr < 0 or cfg.min_lr > cfg.lr:
        errors.append(f"optim.lr={cfg.lr}, optim.min_lr={cfg.min_lr}: need 0 <= min_lr <= lr and lr > 0")
    if cfg.warmup_steps < 0:
        errors.append(f"optim.warmup_steps={cfg.warmup_steps} must be >= 0")
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        errors.append(f"optim.beta1={cfg.beta1}, optim.beta2={cfg.beta2} must be in [0, 1)")
    if cfg.clip_grad < 0:
        errors.append(f"optim.clip_grad={cfg.clip_grad} must be >= 0 (0 disables clipping)")
    if cfg.loss_scale <= 0 or cfg.loss_scale_window < 1:
        errors.append(f"optim.loss_scale={cfg.loss_scale}, optim.loss_scale_window={cfg.loss_scale_window}: need "
                      "loss_scale > 0 and loss_scale_window >= 1; fix: e.g. 65536 and 1000")
    if cfg.fused not in FUSED_BACKENDS:
        errors.append(f"optim.fused={cfg.fused!r} is unknown; fix: one of {', '.join(FUSED_BACKENDS)}")
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
