"""Rotary position embedding on q and k in Triton, forward and backward.

One program per (batch, position): it loads that position's cos/sin once and
rotates every q head and every k head (GQA: k's head count is its own) as a
[heads, head_dim / 2] tile, tails masked, so any even head dim works. Tensors are
[batch, heads, seq, head_dim] with any strides whose last one is 1 (the model's
``view(b, s, h, d).transpose(1, 2)`` included). With the two halves x1, x2 of a
head and c, s the first halves of cos/sin (the tables repeat them):
    forward   y1 = x1 c - x2 s,   y2 = x2 c + x1 s
    backward  the same with -s (the rotation's transpose)
cos/sin are rounded to the input dtype first, as reference.py does; the products
and the sum are computed in fp32 and rounded once.

``inplace=True`` writes the results into q and k (no second q/k buffer; the
backward needs only cos/sin, so autograd allows it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(X, Y, pid_b, pid_s, sxb, sxh, sxs, syb, syh, sys, n_heads, c, s, half, cols, cmask,
            BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < n_heads) & cmask
    xp = X + pid_b * sxb + pid_s * sxs + heads * sxh + cols
    yp = Y + pid_b * syb + pid_s * sys + heads * syh + cols
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(yp, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(yp + half, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, seq_len, half, n_qh, n_kh,
                 sqb, sqh, sqs, skb, skh, sks, sob, soh, sos, skob, skoh, skos, scs,
                 BACKWARD: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_b = pid // seq_len
    pid_s = pid % seq_len
    cols = tl.arange(0, BLOCK_D)[None, :]
    cmask = cols < half
    c = tl.load(COS + pid_s * scs + cols, mask=cmask, other=0.0).to(Q.dtype.element_ty).to(tl.float32)
    s = tl.load(SIN + pid_s * scs + cols, mask=cmask, other=0.0).to(Q.dtype.element_ty).to(tl.float32)
    if BACKWARD:
        s = -s
    _rotate(Q, QO, pid_b, pid_s, sqb, sqh, sqs, sob, soh, sos, n_qh, c, s, half, cols, cmask, BLOCK_QH)
    _rotate(K, KO, pid_b, pid_s, skb, skh, sks, skob, skoh, skos, n_kh, c, s, half, cols, cmask, BLOCK_KH)


def _check(q, k, cos, sin):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [batch, heads, seq, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}")
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:] or k.dtype != q.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not fit q {tuple(q.shape)} {q.dtype}")
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    if cos.shape != (s, d) or sin.shape != (s, d):
        raise ValueError(f"cos/sin must be [seq={s}, head_dim={d}], got {tuple(cos.shape)}, {tuple(sin.shape)}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply(q, k, cos, sin, *, backward: bool = False, out=None):
    """Rotate q and k (by -angle when ``backward``) into ``out`` = (q_out, k_out),
    fresh tensors when None."""
    _check(q, k, cos, sin)
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    qo, ko = out if out is not None else (torch.empty_like(q), torch.empty_like(k))
    cos, sin = cos.contiguous(), sin.contiguous()
    b, n_qh, s, d = q.shape
    n_kh = k.shape[1]
    if b * s:
        _rope_kernel[(b * s,)](
            q, k, qo, ko, cos, sin, s, d // 2, n_qh, n_kh,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
            cos.stride(0), BACKWARD=backward, BLOCK_QH=triton.next_power_of_2(n_qh),
            BLOCK_KH=triton.next_power_of_2(n_kh), BLOCK_D=triton.next_power_of_2(max(d // 2, 1)))
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    """(rope(q), rope(k)); with ``inplace`` q and k are overwritten and returned."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, inplace):
        ctx.save_for_backward(cos, sin)
        if inplace:
            if q.stride(-1) != 1 or k.stride(-1) != 1:
                raise ValueError("inplace rope needs q and k with a contiguous last dim")
            apply(q, k, cos, sin, out=(q, k))
            ctx.mark_dirty(q, k)
            return q, k
        return apply(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = apply(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None, None


def rope(q, k, cos, sin, inplace: bool = False):
    return RoPEFunction.apply(q, k, cos, sin, inplace)
