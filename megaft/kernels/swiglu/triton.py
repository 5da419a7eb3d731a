"""SwiGLU's activation ``silu(gate) * up`` in Triton: elementwise forward and
backward over the flattened tensors, math in fp32, one rounding per output.

Forward rounds silu(gate) to the input dtype before the multiply, as reference.py
(torch) does. Backward recomputes sigmoid(gate) instead of saving it:
    d_up   = dy * silu(g)
    d_gate = dy * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = g * sig
    tl.store(DU + offs, (dy * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} {gate.device} and up "
                         f"{tuple(up.shape)} {up.dtype} {up.device} must match")


def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _fwd_kernel[(triton.cdiv(n, BLOCK),)](g, u, y, n, BLOCK=BLOCK)
    return y


def backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(d_gate, d_up)."""
    dy, g, u = dy.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        _bwd_kernel[(triton.cdiv(n, BLOCK),)](dy, g, u, dg, du, n, BLOCK=BLOCK)
    return dg, du


class SwiGLUFunction(torch.autograd.Function):
    """swiglu(gate, up) = silu(gate) * up."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return backward(dy, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)
