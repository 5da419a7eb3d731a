"""Count, in a CPU run, the calls that make the host wait for the device on CUDA (issue 38).

A CPU test cannot see a stream stall, but it can see its causes: an op whose output size or
value the host must read (`.item()` and every Python scalar of a tensor, `nonzero`, boolean
indexing, `masked_select`, `bincount`, `unique`, `repeat_interleave` without `output_size`)
and a copy to the host (`.cpu()`, `.tolist()`, `.numpy()`). `SyncCounter` counts both while it
is entered. On CPU every tensor stands for a device tensor except the host copies: what `.cpu()`
returns (a new tensor, tagged) and what ops compute from host copies only; reading those is free,
as on a GPU. A tensor made on the host and moved with `.to(device)` counts as a device tensor, and
so does one made on the host and never moved (an overcount, never an undercount).
The GPU test (tests/test_syncs.py) checks the same steps under torch.cuda.set_sync_debug_mode.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose result size or value the host reads on CUDA (each: one sync)
_SIZE_OR_VALUE = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero",
                  aten.masked_select.default: "masked_select", aten.bincount.default: "bincount",
                  aten._unique2.default: "unique", aten.unique_dim.default: "unique",
                  aten.unique_consecutive.default: "unique", aten.is_nonzero.default: "item"}
_INDEX = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
_HOST_COPIES = {torch.Tensor.cpu: "cpu", torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}


_HOST = "_megaft_on_host"  # the tag of a host copy


def _on_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _SIZE_OR_VALUE.get(func)
        if name is None and func in _INDEX and _bool_index(args):
            name = "bool_index"
        if name is None and func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            name = "repeat_interleave"
        inputs = _tensors((args, kwargs))
        host = bool(inputs) and all(_on_host(t) for t in inputs)
        if name is not None and not host:
            self.counts[name] += 1
        out = func(*args, **kwargs)
        if host:  # computed from host copies only: a host tensor too
            for t in _tensors(out):
                setattr(t, _HOST, True)
        return out


class _Copies(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _HOST_COPIES.get(func)
        if name is not None and not _on_host(args[0]):
            self.counts[name] += 1
        out = func(*args, **kwargs)
        if func is torch.Tensor.cpu:  # a new tensor: the device tensor itself stays untagged
            out = out.clone() if out is args[0] else out
            setattr(out, _HOST, True)
        elif func is torch.Tensor.to and _on_host(args[0]) and _moves(args, kwargs):
            out = out.clone() if out is args[0] else out  # to the device: no longer a host copy
            setattr(out, _HOST, False)
        return out


def _moves(args, kwargs) -> bool:
    """Whether a Tensor.to call names a device (not only a dtype)."""
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])


class SyncCounter:
    """`with SyncCounter() as c: ...`; then `c.total` and `c.counts` (by kind)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self._modes = (_Copies(self.counts), _Ops(self.counts))

    def __enter__(self) -> "SyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
