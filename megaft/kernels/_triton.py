"""Triton as a backend: imported lazily, once, with the reason when it cannot run.

Triton kernels run for real on CUDA tensors. On CPU they run only under Triton's
interpreter (``TRITON_INTERPRET=1`` in the environment *before* triton is first
imported), which is how the tests check them on machines without a GPU; the CPU
path of ``backend="auto"`` is always torch.

:func:`unavailable_reason` feeds the dispatch rule shared by the kernel fronts,
:func:`megaft.kernels.dispatch.resolve` (auto|torch|triton|cuda).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch


@functools.cache
def import_error() -> str | None:
    """None when ``import triton`` works, else the original error text."""
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is switched on (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def unavailable_reason(device: torch.device) -> str | None:
    """Why triton kernels cannot run on ``device`` here, or None when they can."""
    err = import_error()
    if err is not None:
        return f"triton does not import ({err}); fix: pip install triton"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if interpreting():
            return None
        return ("tensors are on CPU and Triton compiles for GPUs only; it runs on CPU "
                "only interpreted (set TRITON_INTERPRET=1 before triton is imported, "
                "for tests), otherwise use backend='torch' or 'auto'")
    return f"triton kernels do not run on device type {device.type!r}"


def load(family: str) -> ModuleType:
    """``megaft.kernels.<family>.triton``, imported on first use (so that
    TRITON_INTERPRET, read when kernels are decorated, can still be set first)."""
    return importlib.import_module(f"megaft.kernels.{family}.triton")


def row_settings(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that holds one row of ``n`` elements, as
    Liger's calculate_settings: BLOCK the next power of two, more warps for wider rows."""
    import triton

    block = triton.next_power_of_2(n)
    if block > 65536:
        raise ValueError(f"row of {n} elements is wider than the 65536 a program holds")
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps
