"""Pipeline schedules as data: pure functions returning `{rank: [Action, ...]}`.

Each builder first orders the compute actions (F, B) of every rank, then
`add_send_recv` inserts the point-to-point actions with one fixed rule, so a
runtime can execute a rank's list as written:

* `RECV_F(s, mb)` right before `F(s, mb)` when s is not the first virtual stage,
  `SEND_F(s, mb)` right after it when s is not the last;
* `RECV_B(s, mb)` right before `B(s, mb)` when s is not the last virtual stage,
  `SEND_B(s, mb)` right after it when s is not the first;
* nothing between two virtual stages on the same rank (only possible when pp == 1).

Sends are meant to be non-blocking (isend, or batched with the next receive); the
validator's dry run checks that no schedule here deadlocks under that contract.

Schedules can also come from a CSV file (`load_schedule`/`dump_schedule`), one row
per rank and one action string per cell, like torchtitan's custom CSV schedules.
"""
from __future__ import annotations

import csv
import functools
from pathlib import Path
from typing import Mapping, Sequence

from megaft.config.parallel import Schedule as ScheduleName
from megaft.pipeline.actions import Action, ActionKind, ScheduleError, parse_action

Schedule = dict[int, list[Action]]

SCHEDULES = tuple(s.value for s in ScheduleName)  # parallel.schedule's choices

F, B = ActionKind.F, ActionKind.B
# Action from a (stage, kind, microbatch) tuple without namedtuple's keyword-argument layer:
# the planner builds hundreds of thousands of actions per search
_action = functools.partial(tuple.__new__, Action)


def _check_sizes(pp: int, m: int, chunks: int = 1) -> None:
    for name, value in (("pp", pp), ("num_microbatches", m), ("num_chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def add_send_recv(compute: Mapping[int, Sequence[Action]], pp: int, chunks: int = 1) -> Schedule:
    """Insert SEND/RECV actions around a compute-only schedule (rule in the module docstring).

    Use it on a compute-only CSV (`add_send_recv(load_schedule(path), pp, chunks)`);
    actions that are already communication actions are dropped and re-derived.
    """
    last = pp * chunks - 1
    out: Schedule = {}
    for rank in sorted(compute):
        actions: list[Action] = []
        for a in compute[rank]:
            s, kind, mb = a
            if kind is F:  # rank_of(s ± 1) != rank, inlined: the planner builds many schedules
                pre = s > 0 and (s - 1) % pp != rank
                post = s < last and (s + 1) % pp != rank
                recv, send = ActionKind.RECV_F, ActionKind.SEND_F
            elif kind is B:
                pre = s < last and (s + 1) % pp != rank
                post = s > 0 and (s - 1) % pp != rank
                recv, send = ActionKind.RECV_B, ActionKind.SEND_B
            else:
                continue
            if pre:
                actions.append(_action((s, recv, mb)))
            actions.append(a)
            if post:
                actions.append(_action((s, send, mb)))
        out[rank] = actions
    return out


def gpipe(pp: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards, on every rank.

    Peak activations: m micro-batches per rank. Bubble: (pp-1)/m of the ideal time.
    """
    _check_sizes(pp, m)
    compute = {r: [Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)]
               for r in range(pp)}
    return add_send_recv(compute, pp)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): warm up, alternate, cool down.

    Rank r runs min(pp - r - 1, m) warm-up forwards, then one forward and one
    backward per step, then the remaining backwards. Same bubble as GPipe, (pp-1)/m
    of the ideal time, but at most pp micro-batches in flight on any rank.
    """
    _check_sizes(pp, m)
    compute: Schedule = {}
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [_action((r, F, i)) for i in range(warmup)]
        for i in range(m - warmup):
            order += [_action((r, F, warmup + i)), _action((r, B, i))]
        order += [_action((r, B, i)) for i in range(m - warmup, m)]
        compute[r] = order
    return add_send_recv(compute, pp)


def interleaved_1f1b(pp: int, chunks: int, m: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2) over `chunks` chunks per rank.

    Work is a sequence of m*chunks micro-steps per direction. Micro-batches go in
    groups of pp: micro-step k runs micro-batch (k // (pp*chunks))*pp + k % pp on
    chunk (k // pp) % chunks (reversed for backward). Rank r warms up with
    (pp - r - 1)*2 + (chunks - 1)*pp forwards (capped at m*chunks), then alternates
    one forward and one backward micro-step, then cools down. Bubble: (pp-1)/(chunks*m)
    of the ideal time. Needs m to be a multiple of pp, as Megatron does.
    """
    _check_sizes(pp, m, chunks)
    if m % pp:
        up = -(-m // pp) * pp
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches to be a multiple of pp: got "
            f"num_microbatches={m}, pp={pp}; use a multiple of pp such as "
            f"num_microbatches={up}, or the '1f1b' schedule")
    group = pp * chunks
    total = m * chunks

    def step(rank: int, k: int, kind: ActionKind) -> Action:
        chunk = (k % group) // pp
        if kind is B:
            chunk = chunks - 1 - chunk  # backward walks the chunks last-to-first
        mb = (k // group) * pp + k % pp
        return _action((chunk * pp + rank, kind, mb))

    compute: Schedule = {}
    for r in range(pp):
        warmup = min((pp - r - 1) * 2 + (chunks - 1) * pp, total)
        order = [step(r, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            order += [step(r, warmup + k, F), step(r, k, B)]
        order += [step(r, k, B) for k in range(total - warmup, total)]
        compute[r] = order
    return add_send_recv(compute, pp, chunks)


def build_schedule(name: str, pp: int, m: int, chunks: int = 1) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b" or "interleaved") for pp ranks and m micro-batches."""
    if name == "interleaved":
        return interleaved_1f1b(pp, chunks, m)
    if name in ("gpipe", "1f1b"):
        if chunks != 1:
            raise ValueError(
                f"schedule '{name}' runs one model chunk per rank, got num_chunks={chunks}; "
                f"use schedule 'interleaved' for virtual pipeline stages, or num_chunks=1")
        return gpipe(pp, m) if name == "gpipe" else one_f_one_b(pp, m)
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def dump_schedule(schedule: Mapping[int, Sequence[Action]], path: str | Path) -> None:
    """Write a schedule as CSV: row r holds rank r's actions, one action string per cell."""
    if sorted(schedule) != list(range(len(schedule))):
        raise ScheduleError(f"ranks must be 0..{len(schedule) - 1}, got {sorted(schedule)}")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in range(len(schedule)):
            writer.writerow([str(a) for a in schedule[rank]])


def load_schedule(path: str | Path) -> Schedule:
    """Read a CSV written by `dump_schedule` (or by hand): row r is rank r's actions.

    Empty cells are skipped, so torch's compute-only CSVs (with idle cells) load too;
    for a compute-only file, add the communication with `add_send_recv`. Check the
    result with `megaft.pipeline.validate.validate` before running it.
    """
    schedule: Schedule = {}
    with open(path, newline="") as f:
        for rank, row in enumerate(csv.reader(f)):
            try:
                schedule[rank] = [parse_action(cell) for cell in row if cell.strip()]
            except ScheduleError as e:
                raise ScheduleError(f"{path}, row {rank + 1} (rank {rank}): {e}") from None
    return schedule
