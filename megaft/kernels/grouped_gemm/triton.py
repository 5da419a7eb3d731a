"""The grouped GEMM of a mixture of experts in Triton: forward and both gradients.

Two kernels, both reading the group offsets from the device (``OFFS`` [G + 1], the
prefix sum of the counts), so that one launch covers every group:

- ``_grouped_rows_kernel``: C[rows of g] = A[rows of g] @ B[g], the groups along the
  rows. It is the forward (A = x, B[g] = w[g].T) and the input gradient (A = dy,
  B[g] = w[g]) through strides, no transposed copy. The grid is (row tiles of the
  largest group x column tiles, G): the programs past the end of a smaller group
  return at once, so the launch needs no host-side tile table (the counts change
  every step) and no synchronization.
- ``_grouped_wgrad_kernel``: dW[g] = dY[rows of g].T @ X[rows of g], the groups along
  the contraction; one program per (M tile x K tile, g) walks the group's rows. A
  group without rows stores zeros (the reference's zero gradient, not None).

fp32 accumulation (IEEE fp32 products for fp32 inputs, as torch, not TF32), one rounding
to the output dtype. Tiles are chosen by ``triton.autotune`` per (columns, K, dtype):
never per row count, which changes with the routing. Interpreted on CPU, one small tile,
and half types upcast before tl.dot (the interpreter gets half-type dots wrong; as in
megaft.kernels.linear.triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megaft.kernels import _triton
from megaft.kernels.grouped_gemm.offsets import offsets


@triton.jit
def _mma(acc, a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, fp32 accumulation (IEEE products for fp32 inputs; half types upcast when interpreted)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc += tl.dot(a, b, input_precision="ieee")
    else:
        acc += tl.dot(a, b)
    return acc


@triton.jit
def _grouped_rows_kernel(A, B, C, OFFS, n_cols, k, sam, sak, sbg, sbk, sbn, scm, scn,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    g = tl.program_id(1)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    pid_m = tl.program_id(0) // tiles_n
    pid_n = tl.program_id(0) % tiles_n
    start = tl.load(OFFS + g)
    end = tl.load(OFFS + g + 1)
    row0 = start + pid_m * BLOCK_M
    if row0 < end:
        rm = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        b_base = B + g.to(tl.int64) * sbg
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + rk
            a = tl.load(A + rm[:, None] * sam + ks[None, :] * sak, mask=(rm[:, None] < end) & (ks[None, :] < k),
                        other=0.0)
            b = tl.load(b_base + ks[:, None] * sbk + rn[None, :] * sbn,
                        mask=(ks[:, None] < k) & (rn[None, :] < n_cols), other=0.0)
            acc = _mma(acc, a, b, IEEE, UPCAST)
        cmask = (rm[:, None] < end) & (rn[None, :] < n_cols)
        tl.store(C + rm[:, None] * scm + rn[None, :] * scn, acc.to(C.dtype.element_ty), mask=cmask)


@triton.jit
def _grouped_wgrad_kernel(DY, X, DW, OFFS, m, k, sdym, sdyn, sxm, sxk, sdwg, sdwn, sdwk,
                          IEEE: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # dW[g] [m, k] tile (BLOCK_M x BLOCK_N) over the group's rows, BLOCK_K rows at a time
    g = tl.program_id(1)
    tiles_n = tl.cdiv(k, BLOCK_N)
    rm = ((tl.program_id(0) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = ((tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    start = tl.load(OFFS + g)
    end = tl.load(OFFS + g + 1)
    rr = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + rr
        a = tl.load(DY + rows[None, :] * sdym + rm[:, None] * sdyn, mask=(rows[None, :] < end) & (rm[:, None] < m),
                    other=0.0)
        b = tl.load(X + rows[:, None] * sxm + rn[None, :] * sxk, mask=(rows[:, None] < end) & (rn[None, :] < k),
                    other=0.0)
        acc = _mma(acc, a, b, IEEE, UPCAST)
    dw = DW + g.to(tl.int64) * sdwg + rm[:, None] * sdwn + rn[None, :] * sdwk
    tl.store(dw, acc.to(DW.dtype.element_ty), mask=(rm[:, None] < m) & (rn[None, :] < k))


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for Hopper-class GPUs; 64-row tiles
# first among equals because an expert often gets a few hundred rows.
TILES = [(128, 128, 64, 8, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
         (128, 128, 32, 8, 4), (64, 128, 32, 4, 3), (64, 64, 32, 4, 3)]
INTERPRET_TILES = [(16, 32, 16, 4, 1)]  # tl.dot needs >= 16 per dim; no timing in the interpreter
_SMEM_BUDGET = 160 * 1024  # bytes of staged tiles (H100: 227 KiB per block)


def _fits(configs, named_args, **kwargs):
    """Drop tiles whose pipelined stages exceed the shared-memory budget at these
    operand dtypes (fp32 takes twice the bf16 bytes); keep the smallest otherwise."""
    size = next(v for v in named_args.values() if isinstance(v, torch.Tensor)).element_size()

    def smem(c):
        kw = c.kwargs
        return c.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * size

    return [c for c in configs if smem(c) <= _SMEM_BUDGET] or [min(configs, key=smem)]


def _configs():
    tiles = INTERPRET_TILES if _triton.interpreting() else TILES
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in tiles]


_PRUNE = {"early_config_prune": _fits}
_rows = triton.autotune(_configs(), key=["n_cols", "k"], prune_configs_by=_PRUNE)(_grouped_rows_kernel)
_wgrad = triton.autotune(_configs(), key=["m", "k"], prune_configs_by=_PRUNE)(_grouped_wgrad_kernel)


def _flags(t: torch.Tensor) -> dict:
    interp = t.device.type == "cpu" and t.dtype != torch.float32  # interpreted half types: fp32 products
    return {"IEEE": t.dtype == torch.float32 or interp, "UPCAST": interp}


def grouped_rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, max_rows: int, transpose_b: bool):
    """[N, M'] = a[rows of g] @ b[g] (``transpose_b``: b[g].T) for a [N, K'], b [G, ., .]."""
    n_groups = b.shape[0]
    sbg, sbk, sbn = (b.stride(0), b.stride(2), b.stride(1)) if transpose_b else b.stride()
    n_cols = b.shape[1] if transpose_b else b.shape[2]
    out = torch.empty(a.shape[0], n_cols, dtype=a.dtype, device=a.device)
    if out.numel():
        def grid(meta):
            return triton.cdiv(max_rows, meta["BLOCK_M"]) * triton.cdiv(n_cols, meta["BLOCK_N"]), n_groups

        _rows[grid](a, b, out, offs, n_cols, a.shape[1], a.stride(0), a.stride(1), sbg, sbk, sbn,
                    out.stride(0), out.stride(1), **_flags(a))
    return out


def grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, n_groups: int, dtype: torch.dtype):
    """dW [G, M, K] with dW[g] = dy[rows of g].T @ x[rows of g]; zeros for an empty group."""
    m, k = dy.shape[1], x.shape[1]
    dw = torch.empty(n_groups, m, k, dtype=dtype, device=x.device)
    if dw.numel():
        def grid(meta):
            return triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]), n_groups

        _wgrad[grid](dy, x, dw, offs, m, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                     dw.stride(0), dw.stride(1), dw.stride(2), **_flags(x))
    return dw


class GroupedMM(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ w[g].T; ``offs`` [G + 1] on x's device, ``max_rows``
    the largest count (it sizes the grid)."""

    @staticmethod
    def forward(ctx, x, w, offs, max_rows):
        ctx.save_for_backward(x, w, offs)
        ctx.max_rows = max_rows
        return grouped_rows(x, w, offs, max_rows, transpose_b=True)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dx = grouped_rows(dy, w, offs, ctx.max_rows, transpose_b=False) if ctx.needs_input_grad[0] else None
        dw = grouped_wgrad(dy, x, offs, w.shape[0], w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The reference's ``grouped_mm`` (x, w of one dtype; counts on the CPU)."""
    return GroupedMM.apply(x, w, offsets(counts, x.device), int(counts.max()))
