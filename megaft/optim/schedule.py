"""Learning rate: linear warmup, then cosine decay to the floor at max_steps.

The warmup's length is optim.warmup_steps, or optim.warmup_ratio of max_steps; the floor is
optim.min_lr, or optim.min_lr_ratio of optim.lr (megaft.config.optim: floor_lr, warmup_steps)."""
from __future__ import annotations

import math

from megaft.config.optim import OptimConfig, floor_lr, warmup_steps


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """LR for optimizer step `step` (0-based)."""
    warmup, floor = warmup_steps(cfg, max_steps), floor_lr(cfg)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    span = max(max_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))
