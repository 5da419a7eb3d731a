"""How the runtime posts a schedule's SEND/RECV actions: batches, and why they cannot hang.

A rank's program is its action list with the communication grouped into batches,
each posted as one `batch_isend_irecv` (one NCCL group) between two computes.
`comm_batches` groups each maximal run of adjacent SEND/RECV actions.

NCCL is stricter than gloo: it ignores tags, a send is a rendezvous (nothing is
buffered) and a rank's batches run one after another on its stream. `rendezvous`
replays programs under that model: hosts post batches in order and compute until
an input is missing; a message moves only while the batches holding its send and
its receive are both at the head of their ranks' streams; a batch leaves its stream
once all its messages moved. Some schedules hang there with plain batching (the
interleaved 1F1B with more micro-batches than pp: rank 0 sends a gradient alone
while rank 1 first needs a gradient that rank 0 receives only in its next batch).

`plan` fixes that the way Megatron does, by posting receives early: while the
replay is stuck, a stuck rank's next batch's receives move into its head batch
(a receive may be posted any time before its compute; the order of receives per
peer stays the list order, so NCCL still pairs the right messages). The runtime
executes `plan(...)`'s programs on every backend.
"""
from __future__ import annotations

from typing import Mapping, Sequence, Union

from megaft.pipeline.actions import Action, ActionKind, message_of, rank_of

Program = list[Union[Action, list[Action]]]  # compute actions and batches of SEND/RECV


def comm_batches(actions: Sequence[Action]) -> Program:
    """The list with each maximal run of communication actions grouped into one batch."""
    out: Program = []
    for a in actions:
        if a.kind.is_compute:
            out.append(a)
        elif out and isinstance(out[-1], list):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def input_message(a: Action, pp: int, chunks: int):
    """The message compute `a` consumes from another rank, if any: (direction, sender, mb)."""
    s, kind, mb = a
    src = s - 1 if kind is ActionKind.F else s + 1
    if not 0 <= src < pp * chunks or rank_of(src, pp) == rank_of(s, pp):
        return None
    return ("F" if kind is ActionKind.F else "B", src, mb)


def rendezvous(programs: Mapping[int, Program], pp: int, chunks: int) -> dict[int, tuple[int, int | None]]:
    """Replay `programs` under NCCL's model (module docstring). Returns, for every rank
    that cannot finish, (its program position, the program index of its stream's head
    batch or None); empty when all finish."""
    pc = {r: 0 for r in programs}
    streams: dict[int, list[tuple[int, set]]] = {r: [] for r in programs}  # (index, messages left)
    moved: set[tuple] = set()
    progress = True
    while progress:
        progress = False
        for r, program in programs.items():  # hosts post and compute until an input is missing
            while pc[r] < len(program):
                item = program[pc[r]]
                if isinstance(item, list):
                    streams[r].append((pc[r], {(message_of(a), a.kind.is_send) for a in item}))
                else:
                    need = input_message(item, pp, chunks)
                    if need is not None and need not in moved:
                        break
                pc[r], progress = pc[r] + 1, True
        heads = {r: q[0][1] for r, q in streams.items() if q}
        for r, head in heads.items():  # a message moves when both its ends are at their heads
            for msg, is_send in list(head):
                direction, sender, _ = msg
                peer = rank_of(sender + (1 if direction == "F" else -1) if is_send else sender, pp)
                if peer in heads and (msg, not is_send) in heads[peer]:
                    head.discard((msg, is_send))
                    heads[peer].discard((msg, not is_send))
                    moved.add(msg)
                    progress = True
        for r in heads:
            if not streams[r][0][1]:
                streams[r].pop(0)
                progress = True
    return {r: (pc[r], streams[r][0][0] if streams[r] else None) for r in sorted(programs)
            if pc[r] < len(programs[r]) or streams[r]}


def _prefetch(program: Program, head: int) -> bool:
    """Move the receives of the batch after `head` into batch `head`; False if none."""
    for j in range(head + 1, len(program)):
        if isinstance(program[j], list):
            recvs = [a for a in program[j] if a.kind.is_recv]
            if not recvs:
                return False
            program[head] = program[head] + recvs
            rest = [a for a in program[j] if not a.kind.is_recv]
            if rest:
                program[j] = rest
            else:
                del program[j]
            return True
    return False


def plan(schedule: Mapping[int, Sequence[Action]], pp: int, chunks: int = 1) -> dict[int, Program]:
    """Every rank's program: `comm_batches`, with receives posted early where NCCL's
    rendezvous would otherwise hang. Deterministic, so every rank derives the same plan."""
    programs = {r: comm_batches(actions) for r, actions in schedule.items()}
    for _ in range(sum(len(p) for p in programs.values())):
        stuck = rendezvous(programs, pp, chunks)
        if not any(head is not None and _prefetch(programs[r], head) for r, (_, head) in stuck.items()):
            break
    return programs


def nccl_problems(schedule: Mapping[int, Sequence[Action]], pp: int, chunks: int = 1) -> list[str]:
    """The ranks that would hang on NCCL running `plan(schedule)` (empty when none)."""
    stuck = rendezvous(plan(schedule, pp, chunks), pp, chunks)
    return [f"NCCL deadlock: rank {r} stops at program position {pos}"
            + (f" with batch {head} at its stream's head" if head is not None else "")
            for r, (pos, head) in stuck.items()]
