"""The MoE grouped GEMM (megaft.kernels.grouped_gemm) over [rows, K] sorted by expert and
[G, M, K] expert weights: torch (the reference: a loop of F.linear over the groups),
Triton (one grouped kernel for y and dx, one for dW), cuda (torch._grouped_mm) and, on the
CPU only, torch._grouped_mm called directly (aten's CPU op: the reason the cuda backend is
not offered there). FLOPs: 2·rows·K·M forward, three times that for fwd+bwd.

Shapes are one projection of a real MoE layer with 8192 tokens per micro-batch (rows =
tokens x top-k); the rows per expert are drawn from a skewed router (seeded), as uneven as
a real one.
"""

from __future__ import annotations

import torch

from benchmarks.kernels.providers import Op, cuda_reason
from megaft.kernels.grouped_gemm import cuda, grouped_mm, reference


def _shapes(small: bool) -> list[tuple]:
    if small:
        return [(2048, 256, 512, 8), (4096, 512, 256, 64)]  # rows, K, M, experts
    return [(65536, 2048, 1024, 64),   # OLMoE-1B-7B gate/up: top-8 of 64 experts
            (65536, 1024, 2048, 64),   # its down projection
            (65536, 2048, 768, 128),   # Qwen3-30B-A3B gate/up: top-8 of 128
            (16384, 4096, 7168, 8)]    # Mixtral-8x7B gate/up at tp=2: top-2 of 8


def _inputs(shape, dtype, device, seed):
    rows, k, m, experts = shape
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=gen), dim=0)  # skewed expert loads
    counts = torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=gen), minlength=experts)
    x = torch.randn(rows, k, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(experts, m, k, generator=gen) / k ** 0.5).to(device, dtype).requires_grad_()
    return x, w, counts


def _cpu_only(device: torch.device) -> str | None:
    if device.type != "cpu":
        return "on CUDA tensors this is the cuda provider"
    return None if hasattr(torch, "_grouped_mm") else f"torch {torch.__version__} has no torch._grouped_mm"


OP = Op(
    name="grouped_gemm", shapes=_shapes, inputs=_inputs, kind="compute", validate_shape=(45, 40, 48, 5),
    work=lambda shape, dtype, mode: {"fwd": 2, "full": 6}[mode] * shape[0] * shape[1] * shape[2],
    providers={
        "torch": reference.grouped_mm,
        "triton": lambda x, w, c: grouped_mm(x, w, c, "triton"),
        "cuda": lambda x, w, c: grouped_mm(x, w, c, "cuda"),
        "torch._grouped_mm": cuda.grouped_mm,
    },
    needs={"cuda": cuda_reason("grouped_gemm"), "torch._grouped_mm": _cpu_only},
)
