"""Linear layers' GEMMs with their epilogues, in torch: the specification of triton.py.

    linear(x, w, bias, residual)      x @ w.T (+ bias) (+ residual)   RowParallelLinear's
                                      output (bias + residual, added on one tp rank before the sum)
    linear_swiglu(x, w, bias)         silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up) with
                                      w = cat([w_gate, w_up]) [2F, D]: the MLP's fused gate/up
    wgrad_accumulate_(main_grad, dy, x)   main_grad += dy.T @ x in fp32 (Megatron's
                                      gradient-accumulation fusion into the main grad: fp32,
                                      or bf16 under optim.master_weights, rounded once)
Rounding: matmuls in the input dtype (fp32 accumulation), epilogue in fp32, one rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x, w, bias)
    return y if residual is None else y + residual


def linear_swiglu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = F.linear(x, w, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.no_grad()
def wgrad_accumulate_(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """main_grad [N, K] (fp32, or bf16/fp16 under optim.master_weights) += dy[M, N].T @ x[M, K],
    in place: fp32 math on the upcast buffer, rounded once to its dtype."""
    acc = main_grad.float().addmm_(dy.reshape(-1, dy.shape[-1]).t().float(), x.reshape(-1, x.shape[-1]).float())
    return main_grad if acc is main_grad else main_grad.copy_(acc)
