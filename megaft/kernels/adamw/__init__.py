"""Fused AdamW: one flat fp32 buffer (``adamw_step_``) or a list of tensors of any
sizes, fp32 or bf16 with fp32 masters (``adamw_multi_tensor_``), with a choice of backend.

    torch   reference.py: torch ops, the specification (equals torch.optim.AdamW)
    cpu     megaft._C: one threaded, vectorized pass per tensor (optimizer offload)
    cuda    megaft._cuda: csrc/cuda/adamw*.cu, multi-tensor launches on the current stream
    triton  triton.py: one multi-tensor launch per dtype pair (CUDA tensors; on CPU
            only under TRITON_INTERPRET=1, for tests)

``backend="auto"`` takes, on CPU, megaft._C when built, else torch (never Triton);
on CUDA, megaft._cuda when built, else Triton when it imports, else torch; it logs
that choice once. An explicit backend that is not available raises (never a silent
fallback), with the original import error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from megaft.config.optim import FUSED_BACKENDS as BACKENDS  # optim.fused's choices
from megaft.kernels import _ext, _triton
from megaft.kernels.adamw import cpu, cuda, reference
from megaft.kernels.adamw.tensor_lists import make_lists

__all__ = ["BACKENDS", "adamw_multi_tensor_", "adamw_step_", "resolve_backend"]

log = logging.getLogger(__name__)

_EXT_OF = {"cpu": _ext.C, "cuda": _ext.CUDA}
_logged: set[tuple[str, str]] = set()


def _auto(device: torch.device) -> tuple[str, str]:
    """(backend, why the faster ones were passed over) for backend="auto"."""
    if device.type == "cpu":
        return ("cpu", "") if _ext.C.available else ("torch", _ext.C.error)
    if device.type != "cuda":
        return "torch", f"no compiled kernel for device type {device.type!r}"
    if _ext.CUDA.available:
        return "cuda", ""
    why = _triton.unavailable_reason(device)
    return ("triton", _ext.CUDA.error) if why is None else ("torch", f"{_ext.CUDA.error}; {why}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch", "cpu", "cuda" or "triton") for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"adamw backend must be one of {BACKENDS}, got {backend!r}")
    if backend in _EXT_OF:
        _ext.require(_EXT_OF[backend], f"adamw backend {backend!r}")
    if backend == "triton":
        why = _triton.unavailable_reason(device)
        if why is not None:
            raise RuntimeError(f"adamw backend 'triton' is not available: {why}")
    if backend != "auto":
        return backend
    choice, why = _auto(device)
    if (device.type, choice) not in _logged:
        _logged.add((device.type, choice))
        log.info("adamw backend=auto on %s: using %r%s", device.type, choice,
                 f" ({why})" if why else "")
    return choice


def _multi_impl(backend: str) -> Callable:
    if backend == "triton":
        return _triton.load("adamw").adamw_multi_tensor_
    return {"torch": reference, "cpu": cpu, "cuda": cuda}[backend].adamw_multi_tensor_


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float,
                backend: str = "auto") -> None:
    """One AdamW step (decoupled weight decay, bias correction) in place on
    ``param``, ``exp_avg`` and ``exp_avg_sq``; ``step`` is 1 on the first update.

    All four tensors are contiguous float32 of one shape on one device; the math
    and its rounding are those of ``torch.optim.AdamW(foreach=False)``.
    """
    choice = resolve_backend(backend, param.device)
    if choice == "triton":  # Triton has only the multi-tensor kernel: a list of one
        adamw_multi_tensor_([param], [grad], [exp_avg], [exp_avg_sq], step=step, lr=lr,
                            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                            backend="triton")
        return
    impl = {"torch": reference, "cpu": cpu, "cuda": cuda}[choice].adamw_step_
    impl(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
         eps=eps, weight_decay=weight_decay)


def adamw_multi_tensor_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                        exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                        *, step: int | Sequence[int], lr: float | Sequence[float],
                        beta1: float, beta2: float, eps: float,
                        weight_decay: float | Sequence[float],
                        master_params: Sequence[torch.Tensor] | None = None,
                        backend: str = "auto") -> None:
    """One AdamW step, in place, over lists of tensors of any sizes (one or a few
    kernel launches for all of them on the triton and cuda backends).

    ``params`` are float32, or bfloat16 with float32 ``master_params`` on which the
    update is computed (the params then receive the master rounded to nearest even);
    ``grads`` float32 or bfloat16; moments float32; everything contiguous on one
    device. ``step`` (from 1), ``lr`` and ``weight_decay`` are one number or one per
    tensor (per-group lr/decay). The result equals ``torch.optim.AdamW`` run on the
    masters with ``grad.float()`` (see megaft/kernels/adamw/tensor_lists.py).
    """
    lists = make_lists(params, grads, exp_avgs, exp_avg_sqs, master_params=master_params,
                       step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay)
    if lists.params:
        _multi_impl(resolve_backend(backend, lists.device))(lists)
