"""Activation checkpointing (`model.recompute`, `model.recompute_layers`).

- `full`: a block keeps only its input; its whole forward runs again during backward.
- `selective` (Korthikanti et al. 2022): the attention core (softmax(QKᵀ)V) and the
  SwiGLU/GeGLU activation run again; the linears' outputs are kept.
- `none`: everything the forward saves stays.

torch.utils.checkpoint's non-reentrant form replays the RNG state of the forward
(dropout draws the same mask), and re-runs the tensor-parallel collectives inside a
block in the same order on every tp rank, so recomputation changes no number: losses
and gradients equal `none` bitwise (tests/test_recompute.py).

The setting is a constructor argument all the way down: `Decoder` picks each block's
(`recomputed_layers`), `Block(recompute=...)` wraps its forward for `full` and passes
`selective=` to its Attention and MLP; no module is changed after it is built.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint


def run(fn: Callable, *args, enabled: bool, **kwargs):
    """`fn(*args, **kwargs)`, recomputed in backward when `enabled` and autograd records."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    return fn(*args, **kwargs)


def recomputed_layers(stage_ranges: Sequence[Sequence[int]], count: Optional[int]) -> set[int]:
    """The layers to recompute: the first `count` of every pipeline stage (None = all)."""
    return {i for layers in stage_ranges for i in (list(layers) if count is None else list(layers)[:count])}
