"""Replay a schedule with per-action costs: timelines, bubble and activation memory.

The model is the runtime's contract, with no processes:

* each rank runs its list in order, one action at a time;
* F and B take `cost.forward` / `cost.backward` time units;
* a SEND takes no time on its rank (it is non-blocking / buffered); its message
  arrives `cost.p2p` later;
* a RECV waits until its message has arrived, then takes no time. Its interval in
  the timeline spans the wait, so idle time waiting on a peer is visible.

The same replay with zero costs is the validator's deadlock dry run.

Bubble, precisely. With C = total compute time summed over ranks and T the
makespan (the last action's end), the pipeline holds pp*T rank-time of which C is
useful:

* `bubble_fraction` = 1 - C / (pp*T): idle share of the total time;
  (p-1)/(m+p-1) for GPipe and 1F1B with free p2p.
* `bubble_ratio` = (pp*T - C) / C: idle time relative to the ideal time C/pp,
  the "bubble time fraction" of Narayanan et al. 2021: (p-1)/m for GPipe and 1F1B,
  (p-1)/(v*m) for interleaved 1F1B with v chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from megaft.pipeline.actions import Action, ActionKind, ScheduleError, format_table, message_of

__all__ = ["Cost", "Interval", "SimResult", "simulate", "replay", "replay_many", "peak_in_flight", "format_table"]


@dataclass(frozen=True)
class Cost:
    """Durations, in any time unit, of one micro-batch through one virtual stage."""

    forward: float = 1.0
    backward: float = 2.0
    p2p: float = 0.0  # latency from a SEND to the moment its RECV can complete

    @classmethod
    def per_chunk(cls, chunks: int, forward: float = 1.0, backward: float = 2.0,
                  p2p: float = 0.0) -> "Cost":
        """Costs for a rank whose layers (forward/backward for all of them) are split into `chunks`.

        Interleaving keeps a rank's work constant and cuts it in v pieces, which is
        what the (p-1)/(v*m) bubble formula assumes.
        """
        return cls(forward / chunks, backward / chunks, p2p)

    def duration(self, action: Action) -> float:
        """Time `action` occupies its rank (communication takes none)."""
        if action.kind is ActionKind.F:
            return self.forward
        if action.kind is ActionKind.B:
            return self.backward
        return 0.0


class Interval(NamedTuple):
    """One action of a rank's timeline."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class SimResult:
    """What `simulate` returns. Memory is in micro-batch activations of one chunk."""

    pp: int
    timelines: dict[int, list[Interval]]
    makespan: float
    busy: dict[int, float]  # compute time per rank
    peak_activations: dict[int, int]  # max (stage, mb) forwarded but not yet backwarded

    @property
    def compute(self) -> float:
        """Total compute time C over all ranks."""
        return sum(self.busy.values())

    @property
    def bubble_fraction(self) -> float:
        """1 - C / (pp * makespan): idle share of all rank-time."""
        return 1.0 - self.compute / (self.pp * self.makespan) if self.makespan else 0.0

    @property
    def bubble_ratio(self) -> float:
        """(pp * makespan - C) / C: idle time over ideal time, Narayanan's bubble."""
        return (self.pp * self.makespan - self.compute) / self.compute if self.compute else 0.0


def replay(schedule: Mapping[int, Sequence[Action]], duration: Callable[[Action], float],
           latency: float = 0.0) -> tuple[dict[int, list[Interval]], dict[int, int]]:
    """Run every rank's list under the contract in the module docstring.

    Returns the per-rank timelines and, for ranks that could not finish (deadlock),
    the index of the action each is blocked on ({} when all finished). The result
    does not depend on the order ranks are visited: a rank's times depend only on
    its own list and on when its messages were sent.
    """
    arrival: dict[tuple[str, int, int], float] = {}
    timelines: dict[int, list[Interval]] = {r: [] for r in schedule}
    pos = {r: 0 for r in schedule}
    clock = {r: 0.0 for r in schedule}
    progress = True
    while progress:
        progress = False
        for r, actions in schedule.items():
            while pos[r] < len(actions):
                a, t = actions[pos[r]], clock[r]
                if a.kind.is_recv:
                    sent = arrival.get(message_of(a))
                    if sent is None:
                        break  # blocked until the peer sends
                    end = max(t, sent)
                elif a.kind.is_send:
                    arrival.setdefault(message_of(a), t + latency)
                    end = t
                else:
                    end = t + duration(a)
                timelines[r].append(Interval(t, end, a))
                clock[r], pos[r], progress = end, pos[r] + 1, True
    stuck = {r: pos[r] for r, actions in schedule.items() if pos[r] < len(actions)}
    return timelines, stuck


_COMPUTE, _SEND, _RECV = 0, 1, 2
_NUMPY_FROM = 4  # fewer cost settings than this replay as Python floats: numpy's per-op cost is higher


def replay_many(schedule: Mapping[int, Sequence[Action]], forward: np.ndarray, backward: np.ndarray,
                latency: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`replay` of one schedule for n cost settings at once, without timelines: `forward`
    and `backward` are [n, stages] durations, `latency` [n]. Returns (makespan [n], compute
    time [n, ranks]), equal bit for bit to what replay's timelines give (the same float
    operations in the same order, on arrays). The planner replays thousands of layouts."""
    F, B, SEND_F, SEND_B = ActionKind.F, ActionKind.B, ActionKind.SEND_F, ActionKind.SEND_B
    rows = {r: [(_COMPUTE, a.stage, 0) if a.kind is F else (_COMPUTE, a.stage, 1) if a.kind is B else
                (_SEND if a.kind is SEND_F or a.kind is SEND_B else _RECV, a.stage, message_of(a))
                for a in actions] for r, actions in schedule.items()}
    if len(latency) < _NUMPY_FROM:
        runs = [_run(rows, (forward[i].tolist(), backward[i].tolist()), float(latency[i]), max, 0.0)
                for i in range(len(latency))]
        return np.array([m for m, _ in runs]), np.array([b for _, b in runs])
    makespan, busy = _run(rows, (list(forward.T.copy()), list(backward.T.copy())), latency, np.maximum,
                          np.zeros(len(latency)))
    return makespan, np.stack(busy, axis=1)


def _run(rows: dict, durations: tuple, latency, maximum, zero) -> tuple:
    """replay's loop over (op, stage, what) rows on floats or arrays: (makespan, busy per rank)."""
    arrival: dict = {}
    clock = {r: zero for r in rows}
    busy = {r: 0 for r in rows}  # sum() of each rank's compute intervals, in timeline order
    pos = {r: 0 for r in rows}
    progress = True
    while progress:
        progress = False
        for r, row in rows.items():
            i, n, t, b = pos[r], len(row), clock[r], busy[r]
            while i < n:
                op, stage, what = row[i]
                if op == _COMPUTE:
                    end = t + durations[what][stage]
                    b = b + (end - t)
                elif op == _SEND:
                    arrival.setdefault(what, t + latency)
                    end = t
                else:
                    sent = arrival.get(what)
                    if sent is None:
                        break  # blocked until the peer sends
                    end = maximum(t, sent)
                t, i = end, i + 1
            progress |= i > pos[r]
            pos[r], clock[r], busy[r] = i, t, b
    if any(pos[r] < len(row) for r, row in rows.items()):
        raise ScheduleError("deadlock in replay_many; run megaft.pipeline.validate.validate on the schedule")
    # clocks never go back, so each rank's last end is its latest
    ends = list(clock.values())
    return (max(ends) if maximum is max else np.max(ends, axis=0)), [busy[r] for r in sorted(rows)]


def peak_in_flight(schedule: Mapping[int, Sequence[Action]]) -> dict[int, int]:
    """Per rank, the most (stage, micro-batch) pairs whose F is done and B is not.

    Counts over all the rank's chunks, so it is the peak of stored activations in
    units of one micro-batch through one chunk. Program order decides it: a rank
    runs its actions one at a time.
    """
    peaks: dict[int, int] = {}
    for r, actions in schedule.items():
        live: set[tuple[int, int]] = set()
        peak = 0
        for a in actions:
            if a.kind is ActionKind.F:
                live.add((a.stage, a.microbatch))
                peak = max(peak, len(live))
            elif a.kind is ActionKind.B:
                live.discard((a.stage, a.microbatch))
        peaks[r] = peak
    return peaks


def simulate(schedule: Mapping[int, Sequence[Action]], pp: int, cost: Cost | None = None) -> SimResult:
    """Replay `schedule` on pp ranks with `cost` (default F=1, B=2, free p2p).

    Raises `ScheduleError` (with the schedule's table) if the replay deadlocks; run
    `megaft.pipeline.validate.validate` first for the full set of rules.
    """
    cost = cost or Cost()
    if sorted(schedule) != list(range(pp)):
        raise ScheduleError(f"schedule has ranks {sorted(schedule)}, expected 0..{pp - 1}")
    timelines, stuck = replay(schedule, cost.duration, cost.p2p)
    if stuck:
        blocked = ", ".join(f"rank {r} at {schedule[r][i]} (action {i})" for r, i in stuck.items())
        raise ScheduleError(f"deadlock: {blocked}\n{format_table(schedule)}")
    makespan = max((iv.end for tl in timelines.values() for iv in tl), default=0.0)
    busy = {r: sum(iv.end - iv.start for iv in tl if iv.action.kind.is_compute)
            for r, tl in timelines.items()}
    return SimResult(pp, timelines, makespan, busy, peak_in_flight(schedule))
