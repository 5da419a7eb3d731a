"""Per-phase time of one training step: forward, backward, optimizer, exposed communication.

On CUDA each phase interval is a pair of CUDA events on the current stream, so the
times are GPU time, correct without a synchronize per phase; the one wait is on the
step's last event when the step's numbers are read (the loss `.item()` has synced
already). On CPU the intervals are perf_counter times. Intervals never overlap, so
the phases sum to at most the step time; the rest is data, scheduling and logging.

"comm" is communication nothing hides: time blocked finishing the dp gradient
reduction, in pipeline receives (PipelineRuntime.wait_s) and in the loss all-reduce.
Communication inside a phase (ZeRO-3 gathers in forward, ZeRO's param all-gather in
the optimizer step, the grad-norm all-reduce) counts in that phase.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

PHASES = ("forward", "backward", "optimizer", "comm")
PHASE_KEYS = tuple(f"{p}_s" for p in PHASES)  # the metrics-line fields, seconds


def comm_share(phases: dict) -> float | None:
    """Exposed communication over the phased step, comm_s / (forward_s + backward_s +
    optimizer_s + comm_s); None unless all four are known and their sum is positive."""
    values = [phases.get(k) for k in PHASE_KEYS]
    if any(v is None for v in values) or sum(values) <= 0:
        return None
    return phases["comm_s"] / sum(values)


class PhaseTimer:
    """Sums interval times per phase over one step; `enabled=False` makes it free."""

    def __init__(self, device: torch.device, *, enabled: bool = True):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self._seconds: dict[str, float] = {}
        self._open: Any = None  # the open interval's start: a CUDA event or perf_counter seconds
        self.start_step()

    def start_step(self) -> None:
        self._events = {p: [] for p in PHASES}
        self._seconds = {p: 0.0 for p in PHASES}

    def begin(self, name: str) -> None:
        """Open an interval of phase `name` (closed by `end`; intervals do not nest)."""
        if not self.enabled:
            return
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def end(self, name: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._events[name].append((self._open, stop))
        else:
            self._seconds[name] += time.perf_counter() - self._open

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        yield
        self.end(name)

    def add(self, name: str, seconds: float) -> None:
        """Add host-measured time (the pipeline's receive waits) to `name`."""
        if self.enabled:
            self._seconds[name] += seconds

    def discount(self, name: str, seconds: float) -> None:
        """Take `seconds` timed inside phase `name` out of it (a receive's wait inside a forward:
        the caller adds the pipeline's whole wait_s to comm)."""
        if self.enabled:
            self._seconds[name] -= seconds

    def result(self) -> dict[str, float]:
        """{forward_s, backward_s, optimizer_s, comm_s} of the step; {} when disabled."""
        if not self.enabled:
            return {}
        seconds = dict(self._seconds)
        pairs = [pair for p in PHASES for pair in self._events[p]]
        if pairs:
            torch.cuda.synchronize()  # every recorded event has completed
            for p in PHASES:
                seconds[p] += sum(s.elapsed_time(e) for s, e in self._events[p]) / 1e3
        return {f"{p}_s": max(seconds[p], 0.0) for p in PHASES}

    def timed_handler(self, fn: Callable, name: str) -> Callable:
        """`fn`, a pipeline runtime's forward/backward handler, timed as phase `name`; the
        time its receives block (the step state's wait_s grows) is not compute: the caller
        adds the runtime's wait_s to comm (megaft.pipeline.runtime's wrap_compute)."""
        if not self.enabled:
            return fn

        def handler(stage: int, mb: int, state) -> None:
            waited = state.wait_s
            with self.phase(name):
                fn(stage, mb, state)
            self.discount(name, state.wait_s - waited)
        return handler
