"""The grouped GEMM of a mixture of experts in torch: the specification of triton.py and cuda.py.

``x`` [N, K] holds the rows of every group one after another (tokens sorted by expert),
``w`` [G, M, K] one nn.Linear weight per group, ``counts`` [G] the rows of each group
(zeros allowed). Each group's rows go through their own weight:
``y[rows of g] = x[rows of g] @ w[g].T``. Backward is autograd's: a group without rows
gets a zero weight gradient (F.linear's on an empty slice), not None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[N, K] rows sorted by group, [G, M, K] weights, [G] rows per group -> [N, M]."""
    # unbind, not w[g]: autograd stacks the G weight grads once (w[g] would add G full-size zero tensors)
    return torch.cat([F.linear(rows, w_g) for rows, w_g in zip(x.split(counts.tolist()), w.unbind(0))])
