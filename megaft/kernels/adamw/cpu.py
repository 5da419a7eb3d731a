"""AdamW on the CPU through megaft._C (csrc/cpu/adamw.cpp): one multi-threaded,
vectorized pass over p, g, m, v, with the GIL released."""

from __future__ import annotations

import torch

from megaft.kernels import _ext


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float) -> None:
    """Same contract as :func:`megaft.kernels.adamw.reference.adamw_step_`; needs
    contiguous float32 CPU tensors of one shape."""
    op = _ext.require(_ext.C, "adamw backend 'cpu'").adamw_step_
    op(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay)
