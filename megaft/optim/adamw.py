"""AdamW over FlatParams: one fused kernel call per buffer per step."""
from __future__ import annotations

import torch

from megaft.kernels.adamw import adamw_step_
from megaft.optim.config import OptimConfig
from megaft.optim.flat import FlatParams


class AdamW:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) with fp32 state.

    `optim.fused` picks the kernel (megaft.kernels.adamw): auto, torch, cpu, cuda.
    """

    def __init__(self, flat: FlatParams, cfg: OptimConfig):
        self.flat, self.cfg, self.step_count = flat, cfg, 0
        self.exp_avg = [torch.zeros_like(g.data) for g in flat.groups]
        self.exp_avg_sq = [torch.zeros_like(g.data) for g in flat.groups]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        for g, m, v in zip(self.flat.groups, self.exp_avg, self.exp_avg_sq):
            adamw_step_(g.data, g.grad, m, v, step=self.step_count, lr=lr, beta1=self.cfg.beta1,
                        beta2=self.cfg.beta2, eps=self.cfg.eps, weight_decay=g.weight_decay,
                        backend=self.cfg.fused)
