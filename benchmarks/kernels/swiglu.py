"""SwiGLU's silu(gate) * up over [tokens, ffn]: torch, torch.compile, Triton, CUDA C++,
Liger. Bytes: forward reads gate and up and writes y; backward reads dy, gate and up
and writes both grads."""

from __future__ import annotations

import torch

from benchmarks.kernels.providers import Op, cuda_reason, dtype_size, module_reason
from megaft.kernels.swiglu import reference, swiglu


def shapes(small: bool) -> list[tuple]:
    if small:
        return [(512, 1024), (1024, 2816)]
    return [(8192, 5632), (8192, 11008), (8192, 14336), (4096, 28672)]  # tokens, ffn (1b, 7b, 8b, 70b)


def inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))


def _liger(g, u):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(g, u)


def work(shape, dtype, mode) -> float:
    return {"fwd": 3, "full": 8}[mode] * shape[0] * shape[1] * dtype_size(dtype)


OP = Op(
    name="swiglu", shapes=shapes, inputs=inputs, work=work, validate_shape=(37, 1000),
    providers={
        "torch": reference.swiglu,
        "torch.compile": reference.swiglu,
        "triton": lambda g, u: swiglu(g, u, "triton"),
        "cuda": lambda g, u: swiglu(g, u, "cuda"),
        "liger": _liger,
    },
    needs={"cuda": cuda_reason("swiglu"), "liger": module_reason("liger_kernel")},
)
