"""Fused-AdamW specification in torch ops, on flat tensors.

It is torch's ``_single_tensor_adam`` (torch/optim/adam.py) with
``decoupled_weight_decay=True``, amsgrad/maximize off, for one tensor: the same ops
in the same order with the same Python-float scalars, so it equals
``torch.optim.AdamW(foreach=False)`` bit for bit. The compiled backends are tested
against it.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step in place on ``param``, ``exp_avg`` and ``exp_avg_sq``.

    ``step`` is the 1-based count of this update (torch increments its state step
    before using it).
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)  # decoupled decay (Loshchilov & Hutter)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # Bias corrections in double (Python floats), as torch computes them.
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


@torch.no_grad()
def adamw_multi_tensor_(lists) -> None:
    """The multi-tensor step (``tensor_lists.TensorLists``) as a loop of
    :func:`adamw_step_`: the update on each fp32 master with the gradient in fp32,
    then the param receives the master rounded to its dtype."""
    masters = lists.masters()
    for i, (master, grad, m, v) in enumerate(zip(masters, lists.grads, lists.exp_avgs,
                                                 lists.exp_avg_sqs)):
        adamw_step_(master, grad.float(), m, v, step=lists.steps[i], lr=lists.lrs[i],
                    beta1=lists.beta1, beta2=lists.beta2, eps=lists.eps,
                    weight_decay=lists.weight_decays[i])
        if lists.master_params is not None:
            lists.params[i].copy_(master)  # fp32 -> bf16 is round-to-nearest-even
