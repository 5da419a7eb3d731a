"""What every op benchmark shares: provider availability and the Op description.

An op module (rmsnorm.py, swiglu.py, rope.py, cross_entropy.py) builds one :class:`Op`:
its shapes, an input maker, its providers (name -> callable on the inputs) and the
bytes or FLOPs one call must move or compute, which turn times into rates.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megaft.kernels import _triton, dispatch

ORDER = ("torch", "torch.compile", "torch.chunked", "triton", "cuda", "liger", "apex")


@dataclass
class Op:
    name: str
    shapes: Callable[[bool], list[tuple]]  # small -> shapes
    inputs: Callable[[tuple, torch.dtype, torch.device, int], tuple]  # -> args; grads flow to requires_grad ones
    providers: dict[str, Callable[..., object]]
    work: Callable[[tuple, torch.dtype, str], float]  # (shape, dtype, mode) -> bytes or FLOPs of one call
    kind: str = "memory"  # memory: rate in GB/s vs copy bandwidth; compute: TFLOP/s vs matmul
    validate_shape: tuple = ()
    needs: dict[str, Callable[[torch.device], str | None]] = field(default_factory=dict)  # extra checks


def triton_reason(device: torch.device, interpret_ok: bool) -> str | None:
    if device.type == "cpu" and not interpret_ok:
        return "Triton on CPU is interpreted (not a performance number); pass --interpret to run it anyway"
    return _triton.unavailable_reason(device)


def cuda_reason(op: str) -> Callable[[torch.device], str | None]:
    return lambda device: dispatch.cuda_unavailable_reason(op, device)


def module_reason(name: str) -> Callable[[torch.device], str | None]:
    """None when `name` imports and the device is a GPU (liger and apex are GPU-only)."""

    def reason(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"{name} runs on CUDA only"
        try:
            importlib.import_module(name)
        except ImportError as e:
            return f"{name} does not import ({e})"
        return None

    return reason


@functools.cache
def compiled(fn: Callable) -> Callable:
    """torch.compile of fn, built once per function."""
    return torch.compile(fn, dynamic=False)


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
