"""GEMMs with fused epilogues (megaft.kernels.linear): torch (F.linear, then the epilogue
as separate ops), torch.compile, Triton, CUDA (one cuBLASLt matmul with bias + residual in
its epilogue, csrc/cuda/linear_epilogue.cu). FLOPs: 2·M·N·K forward, three times that for
fwd+bwd (the backward's input and weight gradients are torch matmuls in every provider).

linear_residual: RowParallelLinear's x @ w.T + bias + residual.
linear_swiglu: the MLP's gate/up projection with SwiGLU in the epilogue, w = [2F, D]; its
cuda provider is the cuBLASLt GEMM then the CUDA SwiGLU kernel (no SwiGLU epilogue there).
"""

from __future__ import annotations

import torch

from benchmarks.kernels.providers import Op, cuda_reason
from megaft.kernels.linear import linear, linear_swiglu, reference


def _shapes(small: bool) -> list[tuple]:
    if small:
        return [(256, 512, 512), (512, 1024, 1024)]  # tokens, in, out
    return [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]


def _res_inputs(shape, dtype, device, seed):
    m, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype).requires_grad_()
    b = torch.randn(n, generator=gen).to(device, dtype).requires_grad_()
    r = torch.randn(m, n, generator=gen).to(device, dtype).requires_grad_()
    return x, w, b, r


def _swiglu_inputs(shape, dtype, device, seed):
    m, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(2 * n, k, generator=gen) / k ** 0.5).to(device, dtype).requires_grad_()
    return x, w


RESIDUAL = Op(
    name="linear_residual", shapes=_shapes, inputs=_res_inputs, kind="compute", validate_shape=(37, 40, 50),
    work=lambda shape, dtype, mode: {"fwd": 2, "full": 6}[mode] * shape[0] * shape[1] * shape[2],
    providers={
        "torch": reference.linear,
        "torch.compile": reference.linear,
        "triton": lambda x, w, b, r: linear(x, w, b, r, backend="triton"),
        "cuda": lambda x, w, b, r: linear(x, w, b, r, backend="cuda"),
    },
    needs={"cuda": cuda_reason("linear")},
)

SWIGLU = Op(
    name="linear_swiglu", shapes=_shapes, inputs=_swiglu_inputs, kind="compute", validate_shape=(37, 40, 50),
    work=lambda shape, dtype, mode: {"fwd": 4, "full": 12}[mode] * shape[0] * shape[1] * shape[2],
    providers={
        "torch": reference.linear_swiglu,
        "torch.compile": reference.linear_swiglu,
        "triton": lambda x, w: linear_swiglu(x, w, backend="triton"),
        "cuda": lambda x, w: linear_swiglu(x, w, backend="cuda"),
    },
    needs={"cuda": cuda_reason("linear")},
)
