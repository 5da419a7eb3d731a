"""AdamW on the GPU through megaft._cuda (csrc/cuda/adamw*.cu), launched on the
current CUDA stream of the parameter's device."""

from __future__ import annotations

import torch

from megaft.kernels import _ext


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float) -> None:
    """Same contract as :func:`megaft.kernels.adamw.reference.adamw_step_`; needs
    contiguous float32 CUDA tensors of one shape on one device."""
    op = _ext.require(_ext.CUDA, "adamw backend 'cuda'").adamw_step_
    op(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay)


def adamw_multi_tensor_(lists) -> None:
    """The multi-tensor step (``tensor_lists.TensorLists``) through
    csrc/cuda/adamw_multi_tensor.cu: one launch per kernel-argument struct of up to
    24 tensors / 320 chunks of 64K elements (apex's multi_tensor_apply), per dtype pair."""
    op = _ext.require(_ext.CUDA, "adamw backend 'cuda'").adamw_multi_tensor_
    op(lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs, lists.master_params or [],
       lists.steps, lists.lrs, lists.weight_decays, lists.beta1, lists.beta2, lists.eps)
