"""The parallel linears' CUDA C++ backend, over megaft._cuda's ops:

    torch.ops.megaft.linear_fwd         csrc/cuda/linear_epilogue.cu: y = x @ w.T (+ bias)
                                        (+ residual) as one cuBLASLt matmul, the bias in its
                                        BIAS epilogue and the residual as C with beta = 1
    torch.ops.megaft.wgrad_accumulate   csrc/cuda/wgrad.cu: the weight-gradient accumulation
                                        (Megatron's fused_weight_gradient_mlp_cuda), one
                                        cublasGemmEx with beta = 1 into the main grad: fp32, or
                                        bf16/fp16 (optim.master_weights; wgrad_gemm_accum_fp16)
                                        with fp32 compute, rounded once

Both run on torch's cuBLAS(Lt) handle and current stream with fp32 accumulation. cuBLASLt
has no SwiGLU epilogue, so the gate/up projection here is this GEMM into [tokens, 2F]
followed by the CUDA SwiGLU kernel (csrc/cuda/swiglu.cu); SwiGLU inside the GEMM's
epilogue is the Triton backend's. Availability is checked by the caller
(megaft.kernels.dispatch); autograd is megaft.kernels.linear.fused.
"""

from __future__ import annotations

import torch

from megaft.kernels import _ext
from megaft.kernels.linear.main_grad import MAIN_GRAD_DTYPES


def _ops():
    # Looked up per call: the op exists only once megaft._cuda is imported (dispatch does).
    return torch.ops.megaft


def gemm(x2: torch.Tensor, w: torch.Tensor, bias=None, residual=None) -> torch.Tensor:
    """``x2 @ w.T (+ bias) (+ residual)`` in one cuBLASLt call (fp32 accumulation, bias and
    residual added in fp32, one rounding). All operands share x2's dtype; non-contiguous
    ones are copied here (the op itself refuses them)."""
    ops = _ops()
    if not hasattr(ops, "linear_fwd"):  # a megaft._cuda built before linear_epilogue.cu
        raise RuntimeError("megaft._cuda was built without torch.ops.megaft.linear_fwd "
                           f"(csrc/cuda/linear_epilogue.cu); fix: {_ext.fix_hint(_ext.CUDA)}")
    b = None if bias is None else bias.contiguous()
    r = None if residual is None else residual.contiguous()
    return ops.linear_fwd(x2.contiguous(), w.contiguous(), b, r)


def wgrad_accumulate_(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """main_grad[N, K] (contiguous) += dy[..., N].T @ x[..., K] in one cuBLAS call; dy and x
    share a dtype (fp32, fp16 or bf16); main_grad is fp32, or that same 16-bit dtype (the
    master-weights case: fp32 compute, the sum rounded once to main_grad's dtype)."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    if main_grad.dtype not in MAIN_GRAD_DTYPES or main_grad.shape != (dy2.shape[1], x2.shape[1]):
        raise ValueError(f"main_grad must be fp32, bf16 or fp16 [{dy2.shape[1]}, {x2.shape[1]}], got "
                         f"{main_grad.dtype} {tuple(main_grad.shape)}")
    if dy2.dtype != x2.dtype:
        raise ValueError(f"dy and x must share a dtype, got {dy2.dtype} and {x2.dtype}")
    if main_grad.dtype not in (torch.float32, dy2.dtype):  # cuBLAS: C is fp32 or A/B's 16-bit type
        raise ValueError(f"a {main_grad.dtype} main_grad needs dy and x of that dtype, got {dy2.dtype}; "
                         "fix: cast dy and x to the main grad's dtype, or use an fp32 main grad")
    _ops().wgrad_accumulate(main_grad, dy2, x2)
    return main_grad
