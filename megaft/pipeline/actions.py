"""Pipeline actions: the vocabulary a schedule is written in.

An `Action` is `(stage, kind, microbatch)`. `stage` is the *virtual* stage,
`chunk * pp + rank`, as in Megatron's interleaving: rank r holds model chunks
r, r + pp, r + 2*pp, ... so virtual stage s lives on rank `s % pp`. With one chunk
per rank the virtual stage is the rank.

Communication actions carry the stage that executes them, as in
torch.distributed.pipelining: `SEND_F(s, mb)` sends stage s's output to stage s+1,
which posts the matching `RECV_F(s+1, mb)`; `SEND_B(s, mb)` sends the gradient of
stage s's input to stage s-1, which posts `RECV_B(s-1, mb)`.

String form `"<stage><kind><mb>"`, e.g. `2F0`, `1SEND_F3`, round-trips through
`parse_action` and `str()`.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Mapping, NamedTuple, Sequence


class ActionKind(str, Enum):
    """What an action does; values are torch.distributed.pipelining's names."""

    F = "F"  # forward of one micro-batch through one virtual stage
    B = "B"  # full backward (input and weight gradients)
    SEND_F = "SEND_F"  # send activations to the next virtual stage
    RECV_F = "RECV_F"  # receive activations from the previous virtual stage
    SEND_B = "SEND_B"  # send input gradients to the previous virtual stage
    RECV_B = "RECV_B"  # receive output gradients from the next virtual stage

    # identity tests: the simulator and the planner ask these millions of times
    @property
    def is_compute(self) -> bool:
        return self is ActionKind.F or self is ActionKind.B

    @property
    def is_send(self) -> bool:
        return self is ActionKind.SEND_F or self is ActionKind.SEND_B

    @property
    def is_recv(self) -> bool:
        return self is ActionKind.RECV_F or self is ActionKind.RECV_B


class Action(NamedTuple):
    """One step of a rank's program: `kind` of micro-batch `microbatch` on virtual stage `stage`."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __str__ = __repr__


class ScheduleError(ValueError):
    """A schedule breaks a rule (see `megaft.pipeline.validate`) or cannot be parsed."""


_ACTION_RE = re.compile(r"^(\d+)(F|B|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")


def parse_action(text: str) -> Action:
    """Parse `"2F0"` / `"1SEND_F3"` into an `Action`; raises `ScheduleError` otherwise."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        kinds = ", ".join(k.value for k in ActionKind)
        raise ScheduleError(
            f"cannot parse action {text!r}: expected <stage><kind><microbatch> "
            f"such as '2F0' or '1SEND_F3', with kind one of {kinds}")
    stage, kind, mb = match.groups()
    return Action(int(stage), ActionKind(kind), int(mb))


def rank_of(stage: int, pp: int) -> int:
    """The rank that holds virtual stage `stage` (Megatron interleaving)."""
    return stage % pp


def chunk_of(stage: int, pp: int) -> int:
    """Which of its rank's model chunks virtual stage `stage` is (0-based)."""
    return stage // pp


def message_of(action: Action) -> tuple[str, int, int]:
    """The message a SEND/RECV moves, named the same from both ends: (direction, sending stage, mb).

    Direction is "F" (activations, stage s to s+1) or "B" (gradients, s to s-1).
    """
    s, kind, mb = action
    if kind is ActionKind.SEND_F:
        return ("F", s, mb)
    if kind is ActionKind.SEND_B:
        return ("B", s, mb)
    if kind is ActionKind.RECV_F:
        return ("F", s - 1, mb)
    if kind is ActionKind.RECV_B:
        return ("B", s + 1, mb)
    raise ValueError(f"{action} is a compute action, not a message")


def format_table(schedule: Mapping[int, Sequence[Action]]) -> str:
    """A step x rank grid of the compute actions (F, B), like torch's `_format_pipeline_order`.

    Row i shows each rank's i-th compute action in program order (sends and receives
    are left out to keep the grid readable), so rows are positions in the lists, not
    instants of time; `megaft.pipeline.simulate` gives the timed view.
    """
    ranks = sorted(schedule)
    columns = [[str(a) for a in schedule[r] if a.kind.is_compute] for r in ranks]
    steps = max((len(c) for c in columns), default=0)
    digits = len(str(max(steps - 1, 0)))
    labels = [f"Rank {r}" for r in ranks]
    widths = [max([len(label)] + [len(s) for s in col]) for label, col in zip(labels, columns)]
    lines = [" " * (digits + 7) + " ".join(f"{label:<{w}}" for label, w in zip(labels, widths))]
    for i in range(steps):
        cells = [col[i] if i < len(col) else "" for col in columns]
        row = " ".join(f"{c:<{w}}" for c, w in zip(cells, widths))
        lines.append(f"Step {i:0{digits}d}: {row}".rstrip())
    return "\n".join(lines) + "\n"
