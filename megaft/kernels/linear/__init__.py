"""GEMMs with fused epilogues for the parallel linears, and the weight-gradient
accumulation (Megatron's gradient-accumulation fusion), with a choice of backend.

    torch   reference.py: F.linear and the epilogue as separate ops, the specification
    triton  triton.py: one tiled GEMM kernel, epilogue in registers (bias, residual, SwiGLU)
    cuda    cuda.py: one cuBLASLt matmul with the bias and residual in its epilogue
            (csrc/cuda/linear_epilogue.cu); the weight gradient accumulated into the fp32
            main grad by one cuBLAS GemmEx (csrc/cuda/wgrad.cu, Megatron's fused wgrad)

ColumnParallelLinear / RowParallelLinear call :func:`layer_linear` with
``kernels.linear``: on triton and cuda their forward is the GEMM + epilogue and their
backward accumulates the weight gradient into ``weight.grad`` (fused.py; fp32, or bf16
under optim.master_weights).
cuBLASLt has no SwiGLU epilogue: ``linear_swiglu`` on cuda is the cuBLASLt GEMM into
[tokens, 2F] (bias fused) and then the CUDA SwiGLU kernel, two launches; SwiGLU fused into
the GEMM is Triton only (so is :func:`fused_gate_up`). Backend choice:
megaft.kernels.dispatch.resolve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaft.kernels import _triton, dispatch
from megaft.kernels.linear import reference

# The backends whose forward GEMM adds the bias and the residual itself (RowParallelLinear
# at tp=1 hands them the residual); torch's is F.linear followed by separate adds.
EPILOGUE_BACKENDS = ("triton", "cuda")

__all__ = ["EPILOGUE_BACKENDS", "fused_gate_up", "layer_linear", "linear", "linear_swiglu", "resolve_backend",
           "wgrad_accumulate_"]


def resolve_backend(backend: str, device: torch.device) -> str:
    """"torch", "triton" or "cuda" for ``device`` (the shared rule: auto, explicit, errors)."""
    return dispatch.resolve("linear", backend, device)


def linear(x, w, bias=None, residual=None, backend: str = "auto") -> torch.Tensor:
    """``x @ w.T (+ bias) (+ residual)``."""
    choice = resolve_backend(backend, x.device)
    if choice == "triton":
        return _triton.load("linear").LinearFunction.apply(x, w, bias, residual)
    if choice == "cuda":
        from megaft.kernels.linear.fused import fused_linear

        return fused_linear(x, w, bias, residual, backend="cuda")
    return reference.linear(x, w, bias, residual)


def layer_linear(x, weight, bias=None, residual=None, backend: str = "auto") -> torch.Tensor:
    """The parallel linears' local GEMM ``x @ weight.T (+ bias) (+ residual)``: torch
    (F.linear, then ``residual + y``) or the fused Triton / CUDA path with the weight
    gradient accumulated into ``weight.grad`` (megaft.kernels.linear.fused)."""
    choice = resolve_backend(backend, x.device)
    if choice != "torch":
        from megaft.kernels.linear.fused import fused_linear

        return fused_linear(x, weight, bias, residual, backend=choice)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def fused_gate_up(backend: str, device: torch.device) -> bool:
    """Whether the MLP's gate/up projections + SwiGLU run as one GEMM
    (megaft.kernels.linear.fused.fused_gate_up_swiglu): on the triton linear backend."""
    return resolve_backend(backend, device) == "triton"


def linear_swiglu(x, w, bias=None, backend: str = "auto") -> torch.Tensor:
    """``silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)`` for ``w = cat([w_gate, w_up])``."""
    if w.shape[0] % 2:
        raise ValueError(f"the fused gate/up weight needs an even number of rows, got {w.shape[0]}")
    choice = resolve_backend(backend, x.device)
    if choice == "triton":
        return _triton.load("linear").LinearSwiGLUFunction.apply(x, w, bias)
    if choice == "cuda":  # the GEMM, then the SwiGLU kernel (cuBLASLt has no SwiGLU epilogue)
        from megaft.kernels.swiglu import swiglu

        gate, up = linear(x, w, bias, backend="cuda").chunk(2, dim=-1)
        return swiglu(gate, up, backend="cuda")
    return reference.linear_swiglu(x, w, bias)


def wgrad_accumulate_(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, backend: str = "auto"):
    """``main_grad += dy.T @ x`` in place (main_grad [N, K]: fp32, or bf16/fp16 under
    optim.master_weights, rounded once; dy [..., N], x [..., K])."""
    choice = resolve_backend(backend, main_grad.device)
    if choice == "triton":
        return _triton.load("linear").wgrad_accumulate_(main_grad, dy, x)
    if choice == "cuda":
        from megaft.kernels.linear import cuda

        return cuda.wgrad_accumulate_(main_grad, dy, x)
    return reference.wgrad_accumulate_(main_grad, dy, x)
