"""Dynamic loss scaling for precision=fp16 (Micikevicius et al. 2018; torch.amp.GradScaler's rule).

The loss is multiplied by `scale` before backward so small fp16 gradients do not
flush to zero; the reduced fp32 gradients are divided by it before clipping. If
any gradient on any rank is inf/nan (one all-reduce over the world, so every rank
takes the same decision) the step is skipped, the scale is multiplied by
`backoff`, and the skip is counted; after `growth_interval` good steps in a row the
scale grows by `growth`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class LossScaler:
    def __init__(self, *, init_scale: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 2000):
        self.scale, self.growth, self.backoff, self.growth_interval = init_scale, growth, backoff, growth_interval
        self.good_steps = 0  # finite steps since the last change of scale
        self.skipped = 0  # steps skipped for inf/nan over the whole run

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Divide `grads` by the scale; True when every rank's grads are finite."""
        inv = 1.0 / self.scale
        bad = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(inv)
            bad += (~torch.isfinite(g)).any().float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # the whole world agrees on skipping
        return bad.item() == 0

    def update(self, finite: bool) -> None:
        """Back off and count a skip after an overflow; grow after growth_interval good steps."""
        if not finite:
            self.scale *= self.backoff
            self.skipped += 1
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]
