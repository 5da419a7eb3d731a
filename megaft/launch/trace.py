"""What a rank was waiting for: the last collectives it entered, numbered, for the hang report.

`CollectiveTrace` wraps the torch.distributed collectives and point-to-point calls of
this process (megaft calls them all as `dist.<name>`, so replacing the module's
attributes sees every call) while a rank body runs (megaft.launch.rank.process_group).
Each call gets a sequence number and an entry (op, group size, elements, state:
`waiting` until a blocking call returns, `async` for async_op calls, `done`). The last
`keep` entries, the step the trainer is in (`step_of`, set by run_rank) and the pipeline
action the rank is executing (`action_of`: PipelineRuntime.current_action, e.g. `1F3`,
forward of micro-batch 3 on virtual stage 1; None outside the schedule) go into the
rank's health marker when a collective times out (megaft.launch.health), so the report
can say who was behind and in which call. Recording is a dict append per call:
negligible next to a collective.
"""
from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# Not isend/irecv: dist.P2POp accepts only the original functions (an identity check), and the
# pipeline posts them through batch_isend_irecv, which is traced.
TRACED = ("all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor",
          "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single", "barrier", "send", "recv",
          "batch_isend_irecv", "all_gather_object", "broadcast_object_list")


def _size(args, kwargs) -> tuple[Optional[int], Optional[int]]:
    """(group size, elements of the first tensor argument) of a call, when they can be told."""
    group = kwargs.get("group")
    try:
        gsize = dist.get_world_size(group) if group is not None else dist.get_world_size()
    except (RuntimeError, ValueError):
        gsize = None
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return gsize, a.numel()
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return gsize, a[0].numel()
    return gsize, None


class CollectiveTrace:
    """Records the collectives of this process while installed; `snapshot()` for the marker."""

    def __init__(self, keep: int = 8):
        self.seq = 0
        self.recent: collections.deque = collections.deque(maxlen=keep)
        self.step_of: Callable[[], Optional[int]] = lambda: None
        self.action_of: Callable[[], Optional[object]] = lambda: None
        self._originals: dict[str, Any] = {}

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self.seq += 1
            gsize, numel = _size(args, kwargs)
            entry = {"seq": self.seq, "op": name, "group_size": gsize, "numel": numel, "state": "waiting",
                     "time": time.time()}
            self.recent.append(entry)
            out = fn(*args, **kwargs)
            entry["state"] = "async" if kwargs.get("async_op") or name == "batch_isend_irecv" else "done"
            return out
        return traced

    def install(self) -> "CollectiveTrace":
        for name in TRACED:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._originals:
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def snapshot(self) -> dict[str, Any]:
        """The step, the pipeline action and the last collectives, oldest first (JSON-ready)."""
        step = action = None
        try:
            step = self.step_of()
            action = self.action_of()
        except Exception:  # a report must never fail because of the trainer's state
            pass
        return {"step": step, "action": None if action is None else str(action),
                "collectives": [dict(e) for e in self.recent], "seq": self.seq}


def describe(entry: dict[str, Any]) -> str:
    """`#41 all_reduce(group of 2, 2 elements) waiting`."""
    parts = [f"group of {entry['group_size']}" if entry.get("group_size") else None,
             f"{entry['numel']} elements" if entry.get("numel") is not None else None]
    inside = ", ".join(p for p in parts if p)
    return f"#{entry['seq']} {entry['op']}({inside}) {entry['state']}"
