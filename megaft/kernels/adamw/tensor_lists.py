"""The arguments of a multi-tensor AdamW step: checked once, hyperparameters per tensor.

A step updates N tensors at once. Tensor ``i`` has

    params[i]        float32 or bfloat16; the weights the model computes with
    grads[i]         float32 or bfloat16, same number of elements
    exp_avgs[i]      float32 first moment
    exp_avg_sqs[i]   float32 second moment
    master_params[i] float32 master copy, only when ``master_params`` is given

All contiguous, on one device. Without ``master_params`` every param must be
float32 and is updated in place. With it, the update is computed on the fp32
master (with ``grads[i].float()``) and the param receives the master rounded to its
dtype (round-to-nearest-even for bf16): mixed precision with fp32 master weights, as
apex's FusedAdam and Megatron's distributed optimizer keep them.

``step``, ``lr`` and ``weight_decay`` are a number for all tensors or a sequence with
one entry per tensor (per-group lr / decay, as torch's param groups); beta1, beta2
and eps are shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_PARAM_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class TensorLists:
    """Validated lists, per-tensor ``steps``, ``lrs`` and ``weight_decays``, and the
    shared betas and eps."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    master_params: list[torch.Tensor] | None
    steps: list[int]
    lrs: list[float]
    weight_decays: list[float]
    beta1: float
    beta2: float
    eps: float

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def masters(self) -> list[torch.Tensor]:
        """The fp32 tensors the update is computed on."""
        return self.master_params if self.master_params is not None else self.params


def _per_tensor(name: str, value, n: int, kind: type) -> list:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [kind(value)] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"adamw_multi_tensor_: {name} has {len(values)} entries for {n} "
                         f"tensors; pass one number or one per tensor")
    return [kind(v) for v in values]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"adamw_multi_tensor_: {msg}")


def make_lists(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
               master_params: Sequence[torch.Tensor] | None, step: int | Sequence[int],
               lr: float | Sequence[float], beta1: float, beta2: float, eps: float,
               weight_decay: float | Sequence[float]) -> TensorLists:
    """Check every tensor and hyperparameter (raising ValueError with the fix) and
    expand per-tensor hyperparameters; nothing is modified."""
    lists = dict(params=list(params), grads=list(grads), exp_avgs=list(exp_avgs),
                 exp_avg_sqs=list(exp_avg_sqs))
    if master_params is not None:
        lists["master_params"] = list(master_params)
    n = len(lists["params"])
    for name, ts in lists.items():
        _check(len(ts) == n, f"{name} has {len(ts)} tensors but params has {n}")
    device = lists["params"][0].device if n else None
    seen: dict[int, str] = {}
    for i in range(n):
        p = lists["params"][i]
        _check(p.dtype in _PARAM_DTYPES, f"params[{i}] is {p.dtype}; need float32 or bfloat16")
        _check(p.dtype == torch.float32 or master_params is not None,
               f"params[{i}] is {p.dtype} but no master_params were given; pass fp32 "
               "master_params (the update is computed on them) or float32 params")
        for name, ts in lists.items():
            t = ts[i]
            want = _PARAM_DTYPES if name in ("params", "grads") else (torch.float32,)
            _check(t.dtype in want, f"{name}[{i}] is {t.dtype}; need "
                   + " or ".join(str(d).removeprefix("torch.") for d in want))
            _check(t.device == device, f"{name}[{i}] is on {t.device} but params[0] is on {device}")
            _check(t.is_contiguous(), f"{name}[{i}] is not contiguous; call .contiguous() first")
            _check(t.numel() == p.numel(), f"{name}[{i}] has {t.numel()} elements but "
                   f"params[{i}] has {p.numel()}")
            if t.numel():  # kernels read and write in place: no two operands may alias
                other = seen.setdefault(t.data_ptr(), f"{name}[{i}]")
                _check(other == f"{name}[{i}]", f"{name}[{i}] shares memory with {other}; "
                       "every tensor must be a distinct buffer")
    steps = _per_tensor("step", step, n, int)
    lrs = _per_tensor("lr", lr, n, float)
    wds = _per_tensor("weight_decay", weight_decay, n, float)
    _check(all(s >= 1 for s in steps), f"step counts from 1, got {steps}")
    _check(all(x >= 0 for x in lrs + wds) and eps >= 0,
           "lr, weight_decay and eps must be >= 0")
    _check(0 <= beta1 < 1 and 0 <= beta2 < 1, f"betas must be in [0, 1), got {beta1}, {beta2}")
    lists.setdefault("master_params", None)
    return TensorLists(**lists, steps=steps, lrs=lrs,
                       weight_decays=wds, beta1=float(beta1), beta2=float(beta2),
                       eps=float(eps))


def scalars(lists: TensorLists) -> list[tuple[float, ...]]:
    """Per tensor, the float32 constants of the update, in double then rounded once
    (csrc/cpu/adamw.cpp's make_scalars, i.e. torch's Python-float arithmetic):
    (decay, neg_step, bc2_sqrt, beta2, 1 - beta2, lerp_w, eps). The caller rounds
    them by storing them in a float32 tensor."""
    beta1, beta2, eps = lists.beta1, lists.beta2, lists.eps
    w = float(torch.tensor(1.0 - beta1, dtype=torch.float32))
    # torch's lerp: base m and weight w when |w| < 0.5, else base g and weight w - 1
    # (computed in float, as torch does).
    lerp_w = w if abs(w) < 0.5 else float(torch.tensor(w, dtype=torch.float32) - 1)
    rows = []
    for step, lr, wd in zip(lists.steps, lists.lrs, lists.weight_decays):
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        decay = 1.0 - lr * wd if wd != 0 else 1.0
        rows.append((decay, -(lr / bc1), bc2**0.5, beta2, 1.0 - beta2, lerp_w, eps))
    return rows


def lerp_small(beta1: float) -> bool:
    """Which branch of torch's lerp applies (see :func:`scalars`)."""
    return abs(float(torch.tensor(1.0 - beta1, dtype=torch.float32))) < 0.5
