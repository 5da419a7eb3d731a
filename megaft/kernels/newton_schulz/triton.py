"""The quintic Newton-Schulz step with its two symmetric products in Triton (Dion's and
torchtitan's `newton_schulz_triton` split, written here from the idea, not copied).

A = X X^T and B = b A + c A A^T are symmetric (A is, so A A = A A^T): `_sym_kernel` computes
C = alpha Y Y^T (+ beta Z) for a [batch, m, k] stack Y, one program per BLOCK x BLOCK tile of C
on or above the diagonal only, each storing its tile and, off the diagonal, the tile's
transpose below it: the GEMM's FLOPs of the two products are about halved and the axpy is
its epilogue (fp32 accumulator, alpha acc + beta Z in fp32, one rounding to the output's
dtype). The third product, X <- a X + B X, is not symmetric: torch's (b)addmm, as the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megaft.kernels import _triton


@triton.jit
def _sym_kernel(Y, Z, C, m, k, stride_yb, stride_ym, stride_yk, stride_zb, stride_zm, stride_cb, stride_cm,
                alpha, beta, HAS_Z: tl.constexpr, UPCAST: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_b, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if pid_m > pid_n:  # below the diagonal: the mirror of tile (pid_n, pid_m)
        return
    rm = pid_m * BLOCK + tl.arange(0, BLOCK)
    rn = pid_n * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    Y += pid_b.to(tl.int64) * stride_yb
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + rk
        ym = tl.load(Y + rm[:, None] * stride_ym + kk[None, :] * stride_yk,
                     mask=(rm[:, None] < m) & (kk[None, :] < k), other=0.0)
        yn = tl.load(Y + rn[None, :] * stride_ym + kk[:, None] * stride_yk,
                     mask=(rn[None, :] < m) & (kk[:, None] < k), other=0.0)
        if UPCAST:  # the interpreter's tl.dot is wrong on bf16 (numpy has none): exact fp32 products
            ym, yn = ym.to(tl.float32), yn.to(tl.float32)
        acc += tl.dot(ym, yn)
    acc = acc * alpha
    mask = (rm[:, None] < m) & (rn[None, :] < m)
    if HAS_Z:
        z = tl.load(Z + pid_b.to(tl.int64) * stride_zb + rm[:, None] * stride_zm + rn[None, :], mask=mask, other=0.0)
        acc += beta * z.to(tl.float32)
    if UPCAST and C.dtype.element_ty == tl.bfloat16:  # the interpreter truncates to bf16: round to nearest
        bits = acc.to(tl.uint32, bitcast=True)  # even first (as a GPU's cvt.rn), then the truncation is exact
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        acc = bits.to(tl.float32, bitcast=True)
    out = acc.to(C.dtype.element_ty)
    C += pid_b.to(tl.int64) * stride_cb
    tl.store(C + rm[:, None] * stride_cm + rn[None, :], out, mask=mask)
    if pid_m != pid_n:
        tl.store(C + rn[None, :] * stride_cm + rm[:, None], out, mask=mask)


def sym_gram(y: torch.Tensor, alpha: float = 1.0, z: torch.Tensor | None = None, beta: float = 0.0,
             block: int = 64, block_k: int = 64) -> torch.Tensor:
    """alpha y y^T + beta z for a [batch, m, k] stack y (z: [batch, m, m], contiguous rows; symmetric
    when the result is to be: only the tiles on or above the diagonal are read from it)."""
    batch, m, k = y.shape
    c = torch.empty(batch, m, m, dtype=y.dtype, device=y.device)
    zz = c if z is None else z
    if z is not None and zz.stride(-1) != 1:
        raise ValueError("sym_gram: z's rows must be contiguous")
    grid = (batch, triton.cdiv(m, block), triton.cdiv(m, block))
    _sym_kernel[grid](y, zz, c, m, k, y.stride(0), y.stride(1), y.stride(2), zz.stride(0), zz.stride(1),
                      c.stride(0), c.stride(1), alpha, beta, HAS_Z=z is not None,
                      UPCAST=_triton.interpreting(), BLOCK=block, BLOCK_K=block_k)
    return c


def zeropower_via_newtonschulz(g: torch.Tensor, a: float, b: float, c: float, steps: int,
                               eps: float) -> torch.Tensor:
    """reference.zeropower_via_newtonschulz with A = X X^T and b A + c A A^T from `_sym_kernel`
    (module docstring); the normalisation, orientation and the last product as the reference's."""
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    stack = x if x.dim() == 3 else x.unsqueeze(0)
    stack = stack / stack.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = sym_gram(stack)
        update = sym_gram(gram, c, gram, b)
        stack = torch.baddbmm(stack, update, stack, beta=a)
    x = stack if x.dim() == 3 else stack.squeeze(0)
    return x.mT if tall else x
