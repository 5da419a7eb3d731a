"""RMSNorm (optionally with the residual add fused in front) in Triton.

Forward: one program per row, the whole row in registers (BLOCK = next power of
two of the hidden size, tail masked); it stores the output, the row's 1/rms (fp32)
for backward and, when fused, ``h = x + residual``.
Backward: each program walks a contiguous range of rows, writes dx per row and
accumulates its partial dw in fp32 registers; the partials ([programs, hidden])
are summed afterwards. Rounding follows reference.py: normalized row rounded to
``x.dtype`` before the weight multiply, output in promote(x, weight) dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megaft.kernels._triton import row_settings


@triton.jit
def _fwd_kernel(X, R, H, W, Y, RSTD, n_cols, stride_x, stride_r, stride_h, stride_y, eps,
                HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H + row * stride_h + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    n = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (n * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(DY, X, W, RSTD, DH, DX, DW_PART, n_rows, n_cols, rows_per_program,
                stride_dy, stride_x, stride_dh, stride_dx,
                HAS_DH: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    first = row_start.to(tl.int64)  # 64-bit offsets: rows * stride can pass 2**31
    X += first * stride_x
    DY += first * stride_dy
    DX += first * stride_dx
    DH += first * stride_dh
    RSTD += first
    for _ in range(row_start, row_end):
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD)
        xhat = x * rstd
        dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        if HAS_DH:
            dx += tl.load(DH + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=mask)
        X += stride_x
        DY += stride_dy
        DX += stride_dx
        DH += stride_dh
        RSTD += 1
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=mask)


def _programs(n_rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, 4 * sms))
    return max(1, min(n_rows, 4))  # interpreter: few programs, each a loop


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
    """(y, h or None, rstd) for x of any leading shape; rows are the last dim."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    x2 = x.reshape(-1, n).contiguous()
    r2 = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match "
                             f"x {tuple(x.shape)} {x.dtype}")
        r2 = residual.reshape(-1, n).contiguous()
    m = x2.shape[0]
    block, warps = row_settings(n)
    y = torch.empty((m, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    h = torch.empty_like(x2) if r2 is not None else None
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _fwd_kernel[(m,)](x2, r2 if r2 is not None else x2, h if h is not None else x2,
                          weight.contiguous(), y, rstd, n, x2.stride(0),
                          r2.stride(0) if r2 is not None else 0,
                          h.stride(0) if h is not None else 0, y.stride(0), eps,
                          HAS_RESIDUAL=r2 is not None, BLOCK=block, num_warps=warps)
    return y.view(*x.shape[:-1], n), (h.view(x.shape) if h is not None else None), rstd


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
             dh: torch.Tensor | None):
    """(dx, dweight); ``x`` is the normalized input (h when fused), ``dh`` the
    gradient of the returned h (added to dx), rows are the last dim."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    dy2 = dy.reshape(-1, n).contiguous()
    dh2 = dh.reshape(-1, n).contiguous() if dh is not None else None
    m = x2.shape[0]
    block, warps = row_settings(n)
    programs = _programs(m, x.device)
    rows_per_program = triton.cdiv(m, programs) if m else 0
    dx = torch.empty_like(x2)
    dw_part = torch.zeros((programs, n), dtype=torch.float32, device=x.device)
    if m:
        _bwd_kernel[(programs,)](dy2, x2, weight.contiguous(), rstd,
                                 dh2 if dh2 is not None else dy2, dx, dw_part, m, n,
                                 rows_per_program, dy2.stride(0), x2.stride(0),
                                 dh2.stride(0) if dh2 is not None else 0, dx.stride(0),
                                 HAS_DH=dh2 is not None, BLOCK=block, num_warps=warps)
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """rmsnorm(x, weight, eps, residual) -> y, or (y, x + residual) when residual is given."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, h, rstd = forward(x, weight, eps, residual)
        ctx.fused = residual is not None
        ctx.save_for_backward(h if h is not None else x, weight, rstd)
        return (y, h) if ctx.fused else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = backward(dy, x, weight, rstd, dh if ctx.fused else None)
        return dx, dw, None, (dx if ctx.fused else None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
            residual: torch.Tensor | None = None):
    return RMSNormFunction.apply(x, weight, eps, residual)
