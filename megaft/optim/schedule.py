"""Learning rate: linear warmup, then cosine decay to min_lr at max_steps."""
from __future__ import annotations

import math

from megaft.config.optim import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """LR for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(max_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
