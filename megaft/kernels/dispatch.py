"""The dispatch rule shared by the kernel fronts (rmsnorm, swiglu, rope, cross_entropy, linear,
grouped_gemm).

    torch   the reference (torch ops); always available
    triton  Triton kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (tests)
    cuda    CUDA C++ kernels of megaft._cuda, registered as ``torch.ops.megaft.<op>_*``;
            for the ops of TORCH_CUDA_OPS a CUDA op of torch itself instead
    auto    on CUDA tensors: triton when it imports, else cuda when built, else torch;
            on CPU: torch (Triton runs on CPU only interpreted, in tests)

Liger's rule: ``auto`` picks from what is available and logs its choice once per
(op, device); an explicit backend that cannot run raises with the reason and the fix,
never a silent fallback. Triton goes before cuda under auto because the Triton kernels
are the ones the benchmarks (``python -m benchmarks.kernels``) measure fastest or equal.

This fixed order is what a direct call with ``backend="auto"`` gets. The model's auto
ops are decided before it is built, by timing the available backends on the run's
shapes (megaft.kernels.autotune, ``kernels.autotune=true``), and reach these fronts
as explicit names; ``kernels.autotune=false`` leaves them to this order.
"""

from __future__ import annotations

import logging

import torch

from megaft.config.kernels import BACKENDS  # kernels.*'s choices
from megaft.kernels import _ext, _triton

log = logging.getLogger(__name__)

# The torch.ops.megaft op whose presence means megaft._cuda was built with `op`'s kernel
# (default f"{op}_fwd"); linear's CUDA C++ ops (the cuBLASLt forward, the cuBLAS wgrad
# accumulation) come from one build, so the wgrad op stands for both.
CUDA_OP_NAMES = {"linear": "wgrad_accumulate"}
# Ops whose cuda backend is torch's own CUDA kernel (torch.<name>), not megaft._cuda.
TORCH_CUDA_OPS = {"grouped_gemm": "_grouped_mm"}
_logged: set[tuple[str, str, str]] = set()


def cuda_unavailable_reason(op: str, device: torch.device) -> str | None:
    """Why the CUDA C++ kernel of ``op`` (torch's for TORCH_CUDA_OPS) cannot run on
    ``device``, or None when it can."""
    if op in TORCH_CUDA_OPS:
        return _torch_cuda_reason(op, device)
    if device.type != "cuda":
        return (f"tensors are on {device.type} and the CUDA C++ kernels take CUDA tensors only; "
                "use backend='torch' or 'auto'")
    if not _ext.CUDA.available:
        return f"megaft._cuda is not available ({_ext.CUDA.error}); fix: {_ext.fix_hint(_ext.CUDA)}"
    name = CUDA_OP_NAMES.get(op, f"{op}_fwd")
    if not hasattr(torch.ops.megaft, name):
        return (f"megaft._cuda was built without torch.ops.megaft.{name} (csrc/cuda/kernel_ops.cpp); "
                f"fix: {_ext.fix_hint(_ext.CUDA)}")
    return None


def _torch_cuda_reason(op: str, device: torch.device) -> str | None:
    name = TORCH_CUDA_OPS[op]
    if device.type != "cuda":
        return (f"tensors are on {device.type} and {op}'s cuda backend, torch.{name}, runs on CUDA tensors only "
                "(on the CPU torch's op is a per-group loop, as the torch backend); use backend='torch' or 'auto'")
    if not torch.backends.cuda.is_built():
        return f"torch {torch.__version__} is built without CUDA; fix: a CUDA build of torch"
    if not hasattr(torch, name):
        return (f"torch {torch.__version__} has no torch.{name} (torch >= 2.8 has it); "
                "fix: a newer torch, or backend='triton'")
    return None


def unavailable_reason(op: str, backend: str, device: torch.device) -> str | None:
    """Why an explicit ``backend`` cannot run ``op`` on ``device`` (None: it can)."""
    if backend == "triton":
        return _triton.unavailable_reason(device)
    if backend == "cuda":
        return cuda_unavailable_reason(op, device)
    return None


def resolve(op: str, backend: str, device: torch.device) -> str:
    """The concrete backend ("torch", "triton" or "cuda") for ``op`` on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"{op} backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend != "auto":
        why = unavailable_reason(op, backend, device)
        if why is not None:
            raise RuntimeError(f"{op} backend {backend!r} is not available: {why}")
        return backend
    why = "the CPU path is torch"
    choice = "torch"
    if device.type == "cuda":
        for candidate in ("triton", "cuda"):
            why = unavailable_reason(op, candidate, device)
            if why is None:
                choice = candidate
                break
    if (op, device.type, choice) not in _logged:
        _logged.add((op, device.type, choice))
        log.info("%s backend=auto on %s: using %r%s", op, device.type, choice,
                 f" ({why})" if choice == "torch" and why else "")
    return choice
