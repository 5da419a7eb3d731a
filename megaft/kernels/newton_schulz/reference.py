"""torch.optim.Muon's Newton-Schulz orthogonalisation, op for op (the specification)."""
from __future__ import annotations

import torch


def zeropower_via_newtonschulz(g: torch.Tensor, a: float, b: float, c: float, steps: int,
                               eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of the matrix `g`, the same ops in the same order:
    bf16, the wide orientation, normalised to spectral norm <= 1, then `steps` quintic steps
    X <- a X + (b A + c A A) X, A = X X^T, each product's axpy folded into its GEMM (addmm's
    alpha/beta, as torch.optim.Muon and Keller Jordan's Muon write it). A stack [E, rows, cols]
    (routed experts) is orthogonalised matrix by matrix in one batched pass (baddbmm)."""
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x
