"""Dropout whose mask does not depend on how the tensor is split over tensor parallelism.

The mask is drawn for the WHOLE tensor and this rank keeps its slice: every tp rank of a
replica shares one RNG stream (megaft.training.loop seeds it), so the slices of the same
whole mask are disjoint pieces, as the single process draws them. Used for the residual
dropout under sequence parallel (each tp rank holds a slice of the sequence; drawing only
its own slice's shape would give every rank the same mask, i.e. correlated dropout across
the sequence, and another mask than the single process) and for LoRA's adapter input (a
row-parallel adapter sees a slice of the features). Costs tp x the RNG work of the slice
and one transient whole-sized mask; the saved-for-backward mask is the slice. (Under
sequence parallel with a length that tp does not divide, the sequence is padded first, so
the whole mask has another shape than the single process's and the masks differ.)
"""
from __future__ import annotations

import torch


def sliced_dropout(x: torch.Tensor, p: float, *, dim: int, size: int, start: int) -> torch.Tensor:
    """Inverted dropout of `x`, the slice [start, start + x.shape[dim]) along `dim` of a tensor
    of `size` there; the single process calls it with start=0, size=x.shape[dim]."""
    shape = list(x.shape)
    shape[dim] = size
    keep = torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1.0 - p)
    return x * keep.narrow(dim, start, x.shape[dim]) / (1.0 - p)
