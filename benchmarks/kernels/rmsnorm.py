"""RMSNorm over [tokens, hidden]: torch, torch.compile, Triton, CUDA C++, Liger, apex.
Bytes: forward reads x and writes y, backward reads dy and x and writes dx (the weight
and the row statistics are negligible)."""

from __future__ import annotations

import torch

from benchmarks.kernels.providers import Op, cuda_reason, dtype_size, module_reason
from megaft.kernels.rmsnorm import reference, rmsnorm

EPS = 1e-5


def shapes(small: bool) -> list[tuple]:
    if small:
        return [(512, 1024), (1024, 2048)]
    return [(8192, 2048), (8192, 4096), (8192, 8192), (4096, 5120)]  # tokens (batch x seq), hidden


def inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype).requires_grad_()
    return x, w


def _liger(x, w):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def _apex(x, w):
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine

    return fused_rms_norm_affine(x, w, (x.shape[-1],), EPS)


def work(shape, dtype, mode) -> float:
    per = shape[0] * shape[1] * dtype_size(dtype)
    return {"fwd": 2, "full": 5}[mode] * per


OP = Op(
    name="rmsnorm", shapes=shapes, inputs=inputs, work=work, validate_shape=(37, 1000),
    providers={
        "torch": lambda x, w: reference.rmsnorm(x, w, EPS),
        "torch.compile": lambda x, w: reference.rmsnorm(x, w, EPS),  # compiled by the runner
        "triton": lambda x, w: rmsnorm(x, w, EPS, "triton"),
        "cuda": lambda x, w: rmsnorm(x, w, EPS, "cuda"),
        "liger": _liger,
        "apex": _apex,
    },
    needs={"cuda": cuda_reason("rmsnorm"), "liger": module_reason("liger_kernel"), "apex": module_reason("apex")},
)
