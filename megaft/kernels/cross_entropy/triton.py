"""Cross-entropy statistics and gradient in Triton (see chunked.py for the math).

One program per row walks this rank's vocabulary slice in BLOCK-wide tiles with an
online logsumexp (running max m and sum s rescaled when m grows), so the logits are
read once, in their own dtype, and no fp32 copy of them exists. The gradient kernel
reads each tile again and writes ``g * (exp(x - lse) - [j == label])`` in the logits'
dtype; padded columns (>= n_real) are written as 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megaft.kernels.cross_entropy.reference import IGNORE_INDEX


@triton.jit
def _stats_kernel(X, LABELS, M, S, T, n_real, vocab_start, stride_x, ignore_index,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    m = -float("inf")
    s = 0.0
    for start in range(0, n_real, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_real, other=-float("inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))  # finite: each tile has a real column
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    label = tl.load(LABELS + row)
    local = label - vocab_start
    mine = (label != ignore_index) & (local >= 0) & (local < n_real)
    t = tl.load(x_row + tl.where(mine, local, 0), mask=mine, other=0.0).to(tl.float32)
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(T + row, t)


@triton.jit
def _grad_kernel(X, LABELS, LSE, G, DX, n_cols, n_real, vocab_start, stride_x, stride_dx,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(LSE + row)
    g = tl.load(G + row)
    local = tl.load(LABELS + row) - vocab_start  # ignored labels have g = 0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_real, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == local, p - 1.0, p)
        tl.store(DX + row * stride_dx + cols, (p * g).to(DX.dtype.element_ty), mask=cols < n_cols)


def _block(n: int) -> int:
    # Wide tiles on GPUs (few loop trips over a 32k..128k slice); small ones interpreted.
    cap = 4096 if torch.cuda.is_available() else 256
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


def stats(x: torch.Tensor, labels: torch.Tensor, vocab_start: int, n_real: int):
    """(m, s, t) per row of x [N, V_local] (fp32 each); columns >= n_real are padding."""
    n = x.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = torch.empty(n, dtype=torch.float32, device=x.device)
    s, t = torch.empty_like(m), torch.empty_like(m)
    if n:
        _stats_kernel[(n,)](x, labels.contiguous(), m, s, t, n_real, vocab_start, x.stride(0),
                            IGNORE_INDEX, BLOCK=_block(n_real))
    return m, s, t


def grad(x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
         vocab_start: int, n_real: int) -> torch.Tensor:
    """dx [N, V_local] in x's dtype from the per-token lse and upstream grad g (0 if ignored)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    dx = torch.empty_like(x)
    n, cols = x.shape
    if n and cols:
        _grad_kernel[(n,)](x, labels.contiguous(), lse.contiguous(), g.contiguous(), dx, cols, n_real,
                           vocab_start, x.stride(0), dx.stride(0), BLOCK=_block(cols))
    return dx
