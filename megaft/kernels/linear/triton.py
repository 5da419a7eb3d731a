"""GEMM with fused epilogues, and the weight-gradient accumulation, in Triton.

One tiled kernel computes C = A @ B over [BLOCK_M, BLOCK_N] output tiles with an fp32
accumulator (tl.dot; IEEE fp32 for fp32 inputs so that it matches torch within
rounding, not TF32; bf16 operands upcast first when interpreted on CPU),
then in registers: + bias, + residual, or the SwiGLU of two
accumulators (gate and up halves of one [2F, D] weight), or + the old C upcast to fp32
(ACCUMULATE: ``main_grad += dy.T @ x``, Megatron's gradient-accumulation fusion, no copy
of the weight gradient; a bf16 main grad, optim.master_weights, is rounded once). The
backward of the fused linears uses torch matmuls for the input and weight gradients
(they are plain GEMMs) and recomputes nothing: the SwiGLU pre-activations are stored by
the forward.

Tiles are picked by ``triton.autotune`` per (M, N, K) from GEMM_TILES / SWIGLU_TILES on
a GPU (the first call of each shape times the candidates), and fixed to one small
tile under the CPU interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megaft.kernels import _triton
from megaft.kernels.linear.main_grad import MAIN_GRAD_DTYPES


@triton.jit
def _gemm_kernel(A, B, BU, C, BIAS, BIAS_UP, R, PRE, M, N, K, sam, sak, sbk, sbn, scm, scn, srm, srn,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr,
                 ACCUMULATE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(A + rm[:, None] * sam + ks[None, :] * sak, mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        bmask = (ks[:, None] < K) & (rn[None, :] < N)
        b = tl.load(B + ks[:, None] * sbk + rn[None, :] * sbn, mask=bmask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if SWIGLU:
            bu = tl.load(BU + ks[:, None] * sbk + rn[None, :] * sbn, mask=bmask, other=0.0)
            if UPCAST:
                bu = bu.to(tl.float32)
            if IEEE:
                acc_up += tl.dot(a, bu, input_precision="ieee")
            else:
                acc_up += tl.dot(a, bu)
    cmask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(BIAS_UP + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptr = C + rm[:, None] * scm + rn[None, :] * scn
    if SWIGLU:
        # pre-activations for backward: PRE is [M, 2N] contiguous (gate | up)
        pre = PRE + rm[:, None] * (2 * N) + rn[None, :]
        gate = acc.to(PRE.dtype.element_ty)
        up = acc_up.to(PRE.dtype.element_ty)
        tl.store(pre, gate, mask=cmask)
        tl.store(pre + N, up, mask=cmask)
        g = gate.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(PRE.dtype.element_ty).to(tl.float32)
        acc = act * up.to(tl.float32)
    if HAS_RES:
        acc += tl.load(R + rm[:, None] * srm + rn[None, :] * srn, mask=cmask, other=0.0).to(tl.float32)
    if ACCUMULATE:
        acc += tl.load(c_ptr, mask=cmask, other=0.0).to(tl.float32)
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=cmask)


def _config(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


# Tile candidates (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for Hopper-class GPUs,
# timed once per (M, N, K, flags, dtypes) by triton.autotune. Each compiles for sm_90 with
# bf16 operands without spilling registers (tests/kernels/test_autotune.py); 128x256 and
# 256x128 tiles spill with this kernel's masked, int64-indexed loads and are left out. The
# SwiGLU epilogue keeps two fp32 accumulators (gate and up) live: its tiles hold half the
# outputs (at most 128x128 with 8 warps).
GEMM_TILES = [(128, 128, 64, 8, 4), (64, 256, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 4, 4),
              (64, 128, 64, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 64, 4, 4)]
SWIGLU_TILES = [(128, 128, 64, 8, 3), (128, 64, 64, 8, 4), (64, 128, 64, 8, 4), (128, 64, 32, 4, 4),
                (64, 64, 64, 4, 4), (64, 64, 32, 4, 4)]
# Interpreted on CPU (tests) one small config: tl.dot needs >= 16 per dim, and timing
# candidates in the interpreter would only cost test time.
INTERPRET_TILES = [(16, 32, 16, 4, 1)]
_SMEM_BUDGET = 160 * 1024  # bytes of staged A/B tiles: H100 has 227 KiB per block, leave room for the epilogue


def _fits(configs, named_args, **kwargs):
    """Drop tiles whose pipelined A/B stages exceed the shared-memory budget for these
    operand dtypes (fp32 operands take twice the bf16 bytes); keep the smallest otherwise."""
    size = named_args["A"].element_size()
    swiglu = 2 if kwargs.get("SWIGLU", named_args.get("SWIGLU")) else 1

    def smem(c):
        kw = c.kwargs
        return c.num_stages * (kw["BLOCK_M"] * kw["BLOCK_K"] + swiglu * kw["BLOCK_K"] * kw["BLOCK_N"]) * size

    kept = [c for c in configs if smem(c) <= _SMEM_BUDGET]
    return kept or [min(configs, key=smem)]


def _tiles(tiles):
    return [_config(*t) for t in (INTERPRET_TILES if _triton.interpreting() else tiles)]


_KEY = ["M", "N", "K", "HAS_BIAS", "HAS_RES"]
_PRUNE = {"early_config_prune": _fits}
# Three tuned entry points of the one kernel: each keeps its own best-tile cache.
_gemm = triton.autotune(_tiles(GEMM_TILES), key=_KEY, prune_configs_by=_PRUNE)(_gemm_kernel)
_gemm_swiglu = triton.autotune(_tiles(SWIGLU_TILES), key=_KEY, prune_configs_by=_PRUNE)(_gemm_kernel)
# C += A @ B: each timed candidate adds into C again, so the autotuner restores C after timing.
_gemm_acc = triton.autotune(_tiles(GEMM_TILES), key=_KEY, prune_configs_by=_PRUNE, restore_value=["C"])(_gemm_kernel)


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, bias=None, residual=None, pre=None,
         up_offset: int = 0, b_up=None, bias_up=None, accumulate: bool = False) -> torch.Tensor:
    """out[M, N] (+)= a[M, K] @ b[K, N] with the epilogue; any strides. With ``pre``
    ([M, 2N]) the SwiGLU epilogue: b is the gate, ``b_up`` (same strides as b; default
    b's columns from ``up_offset``: one cat([gate, up]) weight) the up projection, and
    ``bias_up`` (default bias[up_offset:]) its bias. Two separate weights are how the
    model keeps HF's gate_proj / up_proj parameters."""
    if pre is not None and b_up is None:
        b_up = b[:, up_offset:]
        bias_up = bias[up_offset:] if bias is not None else None
    if b_up is not None and b_up.stride() != b.stride():
        raise ValueError(f"gate and up weights need the same strides, got {b.stride()} and {b_up.stride()}")
    m, k = a.shape
    n = out.shape[1]
    # Triton's CPU interpreter gets half-type dot products wrong: products in fp32 there
    # (exact for bf16 inputs, so the comparison with torch stays meaningful).
    interp = a.device.type == "cpu" and a.dtype != torch.float32
    if m and n:
        kernel = _gemm_swiglu if pre is not None else _gemm_acc if accumulate else _gemm
        res = residual if residual is not None else out
        kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))](
            a, b, b_up if b_up is not None else b, out, bias if bias is not None else out,
            bias_up if bias_up is not None else out, res, pre if pre is not None else out,
            m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            res.stride(0), res.stride(1),
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, SWIGLU=pre is not None,
            ACCUMULATE=accumulate, IEEE=a.dtype == torch.float32 or interp, UPCAST=interp)
    return out


class LinearFunction(torch.autograd.Function):
    """x @ w.T (+ bias) (+ residual); x [..., K], w [N, K]."""

    @staticmethod
    def forward(ctx, x, w, bias, residual):
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        r2 = residual.reshape(-1, w.shape[0]) if residual is not None else None
        gemm(x2, w.t(), out, bias=bias, residual=r2)
        ctx.save_for_backward(x, w)
        ctx.flags = (bias is not None, residual is not None)
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        has_bias, has_res = ctx.flags
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ w).view(x.shape)
        dw = dy2.t() @ x.reshape(-1, x.shape[-1])
        return dx, dw, dy2.sum(0) if has_bias else None, dy if has_res else None


class LinearSwiGLUFunction(torch.autograd.Function):
    """silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up), w = cat([w_gate, w_up])."""

    @staticmethod
    def forward(ctx, x, w, bias):
        f = w.shape[0] // 2
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty(x2.shape[0], f, dtype=x.dtype, device=x.device)
        pre = torch.empty(x2.shape[0], 2 * f, dtype=x.dtype, device=x.device)
        gemm(x2, w.t(), out, bias=bias, pre=pre, up_offset=f)
        ctx.save_for_backward(x, w, pre)
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], f)

    @staticmethod
    def backward(ctx, dy):
        from megaft.kernels.swiglu import reference as swiglu_ref

        x, w, pre = ctx.saved_tensors
        gate, up = pre.chunk(2, dim=-1)
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            dg, du = torch.autograd.grad(swiglu_ref.swiglu(g, u), (g, u), dy.reshape(g.shape))
        dpre = torch.cat([dg, du], dim=-1)
        x2 = x.reshape(-1, x.shape[-1])
        return (dpre @ w).view(x.shape), dpre.t() @ x2, dpre.sum(0) if ctx.has_bias else None


def wgrad_accumulate_(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """main_grad[N, K] (fp32, bf16 or fp16) += dy[..., N].T @ x[..., K] in one kernel: the
    fp32 accumulator plus the upcast buffer, rounded once to the buffer's dtype."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    if main_grad.dtype not in MAIN_GRAD_DTYPES or main_grad.shape != (dy2.shape[1], x2.shape[1]):
        raise ValueError(f"main_grad must be fp32, bf16 or fp16 [{dy2.shape[1]}, {x2.shape[1]}], got "
                         f"{main_grad.dtype} {tuple(main_grad.shape)}")
    return gemm(dy2.t(), x2, main_grad, accumulate=True)
