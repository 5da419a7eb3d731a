"""The parallel linears' fused path: GEMM + epilogue forward, dgrad GEMM + the weight
gradient accumulated straight into ``weight.grad`` (Megatron's
gradient_accumulation_fusion) backward.

``weight.grad`` is FlatParams' persistent view into the flat gradient buffer (the main
grad): fp32, or bf16 under ``optim.master_weights`` (bf16 params and grads, fp32
masters in the optimizer). When it is there, backward adds ``dy.T @ x`` into it with one
kernel (fp32 accumulation plus the upcast buffer, rounded once to the buffer's dtype:
Megatron's wgrad_gemm_accum_fp32 / _fp16; no weight-sized gradient in the compute dtype,
no separate add, which for a bf16 buffer would round twice) and hands autograd a zero
placeholder of the buffer's dtype (a stride-0 expanded scalar, no allocation) instead of
the weight gradient. Autograd's AccumulateGrad still runs for the weight,
adding the zeros in place: that keeps the dp reducer's post-accumulate-grad hooks
(megaft.parallel.data.buckets) firing at the right moment, and keeps tied weights exact (the
head's share is already in the buffer, the embedding's arrives through autograd).
Without a main grad (before FlatParams, ZeRO-2's keep_grads=False, frozen weights)
the weight gradient is returned normally.

Under autocast the inputs are cast to the autocast dtype here (as F.linear would be);
the weight stays the fp32 parameter so its .grad is reachable.

``backend`` "triton" runs the forward GEMM + epilogue and the accumulation in Triton;
"cuda" runs the forward GEMM + bias/residual epilogue as one cuBLASLt matmul
(megaft.kernels.linear.cuda.gemm, csrc/cuda/linear_epilogue.cu) and the accumulation with
cuBLAS GemmEx (csrc/cuda/wgrad.cu). The gate/up SwiGLU GEMM is Triton only (cuBLASLt has
no SwiGLU epilogue).
"""
from __future__ import annotations

from typing import Optional

import torch

from megaft.kernels.linear.main_grad import compute_dtype, main_grad


class FusedLinearFunction(torch.autograd.Function):
    """x @ w.T (+ bias) (+ residual) on `backend`; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, backend="triton"):
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            r2 = residual.reshape(-1, w.shape[0]) if residual is not None else None
            if backend == "cuda":
                from megaft.kernels.linear import cuda as cu_linear

                out = cu_linear.gemm(x2, w, b, r2)
            else:
                from megaft.kernels.linear import triton as tl_linear

                out = torch.empty(x2.shape[0], w.shape[0], dtype=dtype, device=x.device)
                tl_linear.gemm(x2, w.t(), out, bias=b, residual=r2)
        ctx.save_for_backward(x2, w, weight)
        ctx.backend = backend
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.has_res = residual is not None
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(w.dtype)
        dx = (dy2 @ w).view(ctx.x_shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = _weight_grad(weight, dy2, x2, ctx.backend) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, (dy if ctx.has_res else None), None


def _weight_grad(weight: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor, backend: str = "triton") -> torch.Tensor:
    """dy2.T @ x2 into weight's main grad (returning the zero placeholder), or returned."""
    buf = main_grad(weight)
    # cuBLAS adds into a 16-bit buffer only from operands of its dtype (an fp16 weight
    # under bf16 autocast is not): autograd's unfused path there
    if buf is None or (backend == "cuda" and buf.dtype not in (torch.float32, dy2.dtype)):
        return (dy2.t() @ x2).to(weight.dtype)
    if backend == "cuda":
        from megaft.kernels.linear import cuda as cu_linear

        cu_linear.wgrad_accumulate_(buf, dy2, x2)
    else:
        from megaft.kernels.linear import triton as tl_linear

        tl_linear.wgrad_accumulate_(buf, dy2, x2)
    # zeros for AccumulateGrad: its hooks (the dp reducer) must still fire; of the buffer's
    # dtype (== weight's, main_grad checks), so the in-place add is exact and keeps the view
    return torch.zeros((), dtype=buf.dtype, device=weight.device).expand(weight.shape)


class FusedGateUpFunction(torch.autograd.Function):
    """silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up) in one GEMM over the two separate
    weights (HF's gate_proj / up_proj, no cat): the kernel reads both and keeps the
    pre-activations for backward; weight gradients as FusedLinearFunction's."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, b_gate, b_up):
        from megaft.kernels.linear import triton as tl_linear

        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            wg, wu = w_gate.to(dtype), w_up.to(dtype)
            bg = b_gate.to(dtype) if b_gate is not None else None
            bu = b_up.to(dtype) if b_up is not None else None
            f = wg.shape[0]
            out = torch.empty(x2.shape[0], f, dtype=dtype, device=x.device)
            pre = torch.empty(x2.shape[0], 2 * f, dtype=dtype, device=x.device)
            tl_linear.gemm(x2, wg.t(), out, bias=bg, pre=pre, b_up=wu.t(), bias_up=bu)
        ctx.save_for_backward(x2, wg, wu, pre, w_gate, w_up)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = b_gate.dtype if b_gate is not None else None
        return out.view(*x.shape[:-1], f)

    @staticmethod
    def backward(ctx, dy):
        from megaft.kernels.swiglu import reference as swiglu_ref

        x2, wg, wu, pre, w_gate, w_up = ctx.saved_tensors
        gate, up = pre.chunk(2, dim=-1)
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            dg, du = torch.autograd.grad(swiglu_ref.swiglu(g, u), (g, u), dy.reshape(g.shape).to(g.dtype))
        need = ctx.needs_input_grad
        dx = (dg @ wg + du @ wu).view(ctx.x_shape).to(ctx.x_dtype) if need[0] else None
        dwg = _weight_grad(w_gate, dg, x2) if need[1] else None
        dwu = _weight_grad(w_up, du, x2) if need[2] else None
        dbg = dg.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and need[3] else None
        dbu = du.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and need[4] else None
        return dx, dwg, dwu, dbg, dbu


def fused_gate_up_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                         b_gate: Optional[torch.Tensor] = None, b_up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)``: the MLP's gate/up projections
    and SwiGLU in one Triton GEMM (see FusedGateUpFunction)."""
    return FusedGateUpFunction.apply(x, w_gate, w_up, b_gate, b_up)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 residual: Optional[torch.Tensor] = None, backend: str = "triton") -> torch.Tensor:
    """``x @ weight.T (+ bias) (+ residual)`` with `backend`'s GEMM ("triton" or "cuda") and
    the fused weight gradient. The residual is fused only when it already has the compute
    dtype (fp32 runs): under autocast `residual + y` adds a bf16 y to the fp32 stream, so it
    stays separate to give the same result as the unfused path."""
    if residual is not None and residual.dtype != compute_dtype(x):
        return residual + FusedLinearFunction.apply(x, weight, bias, None, backend)
    return FusedLinearFunction.apply(x, weight, bias, residual, backend)
