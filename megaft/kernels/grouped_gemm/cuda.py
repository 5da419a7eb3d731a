"""The grouped GEMM on torch's own kernel, ``torch._grouped_mm``: forward and both gradients.

On sm90/sm100 with bf16 operands torch runs a CUTLASS grouped GEMM, one launch for every
group; other GPUs and dtypes (fp32, fp16) go to aten's fallback, one mm per group after
copying the offsets to the host. Either way it is what transformers' ``grouped_mm``
experts path runs. The three products are its three layouts: y = x @ w[g].T (2d x 3d,
groups along x's rows), dx = dy @ w[g] (the same), dW = dy.T @ x (2d x 2d, groups along
the contraction; an empty group gets zeros).

torch's rules, checked here with the fix rather than left to torch's message: fp32, bf16
or fp16 operands of one dtype, and rows of 16 bytes (K and M multiples of 16 / element
size: 4 fp32, 8 bf16/fp16), as its TMA loads need. Operands are made row-major and
16-byte aligned (a copy only where they are not).

Only on CUDA tensors through the dispatch rule (megaft.kernels.dispatch), as every family's
``cuda``. On the CPU ``torch._grouped_mm`` is aten's fallback, the same per-group loop of
mm as the torch backend (1.2-1.45x its speed on 2 cores, ``python -m benchmarks.kernels
--op grouped_gemm``: it writes into the output rather than concatenating, and the weight
grads in place rather than stacking them) under stricter stride rules; not offered, since
``auto`` on CPU is torch in every family and a ``cuda`` that runs on CPU tensors would
blur what the name means. The functions here run on any device: the tests check this
wiring on the CPU.
"""

from __future__ import annotations

import torch

from megaft.kernels.grouped_gemm.offsets import offsets

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why torch._grouped_mm cannot take (x, w), with the fix; None when it can."""
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        return f"needs x and w of one dtype among fp32, bf16, fp16, got {x.dtype} and {w.dtype}"
    align = 16 // x.element_size()
    m, k = w.shape[1], w.shape[2]
    if m % align or k % align:
        return (f"needs rows of 16 bytes: M={m} and K={k} multiples of {align} for {x.dtype}; "
                "fix: backend='triton' or 'torch'")
    return None


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides and a 16-byte aligned start (a copy only where needed:
    a size-1 dim may carry any stride in a "contiguous" tensor, which torch's check refuses)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.insert(0, step)
        step *= size
    if t.stride() == tuple(strides) and t.data_ptr() % 16 == 0:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


class GroupedMM(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ w[g].T with ``ends`` [G] (int32, on x's device) the
    cumulative counts, torch._grouped_mm's ``offs``. The weight gradient is dy.T @ x with
    dy.T column-major and x row-major: the layout of torch's own _grouped_mm backward."""

    @staticmethod
    def forward(ctx, x, w, ends):
        x, w = _dense(x), _dense(w)
        ctx.save_for_backward(x, w, ends)
        if x.shape[0] == 0:  # nothing for the kernel to do
            return x.new_empty(0, w.shape[1])
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, dy):
        x, w, ends = ctx.saved_tensors
        dx = dw = None
        if x.shape[0] == 0:
            return torch.zeros_like(x), torch.zeros_like(w), None
        dy = _dense(dy)
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dy, w, offs=ends)
        if ctx.needs_input_grad[1]:
            dw = torch._grouped_mm(dy.t(), x, offs=ends)
        return dx, dw, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The reference's ``grouped_mm`` on torch._grouped_mm (counts on the CPU)."""
    why = unsupported(x, w)
    if why is not None:
        raise ValueError(f"grouped_gemm backend 'cuda' (torch._grouped_mm) {why}")
    return GroupedMM.apply(x, w, offsets(counts, x.device, dtype=torch.int32, start=False))
