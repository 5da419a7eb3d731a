"""FlatParams: parameters and gradients as views into contiguous fp32 buffers.

One buffer per weight-decay group lets the optimizer run one fused kernel over the
whole model (megaft._C / megaft._cuda take flat tensors) and the data-parallel
reduction run one collective. Autograd accumulates into the existing `.grad`
views in place, so the buffers always hold the gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FlatGroup:
    params: list[nn.Parameter]
    data: torch.Tensor  # flat fp32 values; every param's .data is a view into it
    grad: torch.Tensor  # flat fp32 gradients; every param's .grad is a view into it
    weight_decay: float


def _flatten(params: list[nn.Parameter], weight_decay: float, device: torch.device) -> FlatGroup:
    total = sum(p.numel() for p in params)
    data = torch.zeros(total, dtype=torch.float32, device=device)
    grad = torch.zeros(total, dtype=torch.float32, device=device)
    offset = 0
    for p in params:
        n = p.numel()
        data[offset:offset + n].copy_(p.detach().reshape(-1))
        p.data = data[offset:offset + n].view_as(p)
        p.grad = grad[offset:offset + n].view_as(p)
        offset += n
    return FlatGroup(params, data, grad, weight_decay)


class FlatParams:
    """Groups: matrices (weight decay) and vectors (norms, biases: no decay)."""

    def __init__(self, model: nn.Module, *, weight_decay: float, device: torch.device):
        params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.groups = [g for g in (_flatten(decay, weight_decay, device), _flatten(no_decay, 0.0, device))
                       if g.params]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad.zero_()
