"""What a forward saves for backward, counted: the activation memory the estimate
(megaft.perf.counts.activation_bytes_per_token) predicts, measured on any device with
`torch.autograd.graph.saved_tensors_hooks` during a real forward."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def saved_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages `forward()` saves for backward, other than the
    model's parameters and buffers (a storage saved by several ops counts once)."""
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def block_bytes(measure: Callable[[int, int], int], seq: int) -> float:
    """One block's saved bytes for rows of `seq` tokens, from `measure(layers, seq)` (the
    saved bytes of a model with that many layers on rows that long): 4 against 2 blocks
    at 2*seq against seq tokens, so the embedding, the head, the loss and anything
    weight-sized cancel."""
    return (measure(4, 2 * seq) - measure(2, 2 * seq) - measure(4, seq) + measure(2, seq)) / 2
