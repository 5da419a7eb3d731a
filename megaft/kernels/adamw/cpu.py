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


def adamw_multi_tensor_(lists) -> None:
    """The multi-tensor step (``tensor_lists.TensorLists``) as one megaft._C call per
    tensor (each is already one threaded pass), on CPU tensors."""
    op = _ext.require(_ext.C, "adamw backend 'cpu'").adamw_step_
    masters = lists.masters()
    for i, (master, grad, m, v) in enumerate(zip(masters, lists.grads, lists.exp_avgs,
                                                 lists.exp_avg_sqs)):
        op(master, grad.float(), m, v, lists.steps[i], lists.lrs[i], lists.beta1, lists.beta2,
           lists.eps, lists.weight_decays[i])
        if lists.master_params is not None:
            lists.params[i].copy_(master)  # round-to-nearest-even into bf16
