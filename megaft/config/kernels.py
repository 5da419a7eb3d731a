"""KernelsConfig (`kernels.*`): which backend runs each fused op of the model.

``kernels.backend`` applies to every op; a per-op field overrides it (None = follow
``backend``). ``auto`` keeps the CPU path on torch; on CUDA it runs, per op, the available
backend measured fastest on the run's shapes (``autotune``, megaft.kernels.autotune), or
with ``autotune=false`` Triton, else the CUDA C++ kernels, else torch
(megaft.kernels.dispatch). An explicit backend that cannot run on the run's device is
reported before any rank starts, with the fix (megaft.kernels.checks.check_kernels).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

BACKENDS = ("auto", "torch", "triton", "cuda")  # megaft.kernels.dispatch runs them
OPS = ("rmsnorm", "rope", "swiglu", "cross_entropy", "linear", "grouped_gemm")
# auto | torch | triton | cuda (megaft.kernels.dispatch), as an enum Hydra checks when composing
KernelBackend = StrEnum("KernelBackend", [(b, b) for b in BACKENDS])


@dataclass
class KernelsConfig:
    backend: KernelBackend = KernelBackend.auto  # auto | torch | triton | cuda, every op without an override
    rmsnorm: Optional[KernelBackend] = None  # RMSNorm (+ the fused residual add); None = `backend`
    rope: Optional[KernelBackend] = None  # rotary embedding of q and k; None = `backend`
    swiglu: Optional[KernelBackend] = None  # the MLP's silu(gate) * up; None = `backend`
    cross_entropy: Optional[KernelBackend] = None  # vocab-parallel loss; None = `backend`
    linear: Optional[KernelBackend] = None  # parallel linears: GEMM + epilogue, wgrad fused into the main grad
    grouped_gemm: Optional[KernelBackend] = None  # MoE experts' grouped GEMMs (cuda: torch._grouped_mm)
    fused_linear_cross_entropy: bool = False  # head projection + loss chunk by chunk (never all logits)
    ce_chunk_tokens: int = 2048  # tokens per chunk of the fused linear cross-entropy
    autotune: bool = True  # auto on CUDA: time the available backends once per shape (false: fixed order)
    autotune_cache: str = ""  # JSON file of measured choices; "" = $MEGAFT_CACHE_DIR or ~/.cache/megaft

    def for_op(self, op: str) -> str:
        """The backend asked for `op`: the override, else `backend` (a global cuda
        means auto for the ops without a CUDA C++ kernel)."""
        if op not in OPS:
            raise ValueError(f"unknown kernel op {op!r}; one of {OPS}")
        override = getattr(self, op)
        if override:
            return override
        return "auto" if self.backend == "cuda" and op not in CUDA_OPS else self.backend


# Ops with a cuda backend: a CUDA C++ kernel (linear's: the cuBLASLt forward GEMM + epilogue and the cuBLAS
# wgrad accumulation), or for grouped_gemm torch's own torch._grouped_mm (dispatch.TORCH_CUDA_OPS).
CUDA_OPS = ("rmsnorm", "rope", "swiglu", "cross_entropy", "linear", "grouped_gemm")
