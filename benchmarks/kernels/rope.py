"""RoPE on q [batch, heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim] (GQA):
torch, torch.compile, Triton, CUDA C++. Bytes: q and k read and written, forward and
backward alike (the cos/sin tables are small and cached)."""

from __future__ import annotations

import torch

from benchmarks.kernels.providers import Op, cuda_reason, dtype_size
from megaft.kernels.rope import reference, rope
from megaft.models.attention.rope import inv_frequencies, rope_tables


def shapes(small: bool) -> list[tuple]:
    if small:
        return [(1, 8, 2, 256, 64), (2, 8, 8, 512, 64)]  # batch, heads, kv heads, seq, head dim
    return [(1, 32, 8, 2048, 128), (1, 32, 8, 8192, 128), (2, 64, 8, 4096, 128)]


def inputs(shape, dtype, device, seed):
    b, h, kv, s, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(b, kv, s, d, generator=gen).to(device, dtype).requires_grad_()
    cos, sin = rope_tables(inv_frequencies(d, 10000.0), s)
    return q, k, cos.to(device), sin.to(device)


def work(shape, dtype, mode) -> float:
    b, h, kv, s, d = shape
    return {"fwd": 2, "full": 4}[mode] * b * (h + kv) * s * d * dtype_size(dtype)


OP = Op(
    name="rope", shapes=shapes, inputs=inputs, work=work, validate_shape=(2, 6, 2, 37, 48),
    providers={
        "torch": reference.rope,
        "torch.compile": reference.rope,
        "triton": lambda q, k, c, s: rope(q, k, c, s, "triton"),
        "cuda": lambda q, k, c, s: rope(q, k, c, s, "cuda"),
    },
    needs={"cuda": cuda_reason("rope")},
)
