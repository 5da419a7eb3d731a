"""Rules a schedule must follow, checked without processes (torch's TestSchedulePlan rules).

`validate(schedule, pp, m, chunks)` raises `ScheduleError` listing every broken
rule, followed by `format_table(schedule)`:

1. ranks are 0..pp-1; every action names a virtual stage in 0..pp*chunks-1 and a
   micro-batch in 0..m-1, and sits on the rank that owns its stage;
2. each (stage, mb) has exactly one F and one B, and the F comes first;
3. data dependencies: F(s, mb) runs after F(s-1, mb), B(s, mb) after B(s+1, mb).
   Across ranks that means the producer is followed by its SEND and the consumer
   preceded by its RECV; on one rank, by list order;
4. every SEND has exactly one matching RECV on the peer (same stage edge,
   micro-batch and direction) and vice versa, and between each ordered pair of
   ranks the sends are listed in the same order as the receives, because NCCL
   matches point-to-point messages between two ranks in posting order (no tags);
5. a dry run (RECV blocks until its SEND happened, SEND is buffered) finishes,
   i.e. the schedule cannot deadlock under the runtime's contract;
6. with `nccl=True`: the runtime's batches (`megaft.pipeline.comm_plan.plan`)
   finish a dry run under NCCL's rendezvous semantics (`nccl_problems`): no
   buffering, one stream per rank. Every built schedule passes it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from megaft.pipeline.actions import Action, ActionKind, ScheduleError, format_table, message_of, rank_of
from megaft.pipeline.comm_plan import nccl_problems
from megaft.pipeline.simulate import peak_in_flight, replay

__all__ = ["validate", "nccl_problems", "peak_in_flight", "ScheduleError"]

K = ActionKind
_MAX_LISTED = 20  # enough to diagnose; a broken generator would otherwise print thousands


def _placement(schedule, pp: int, m: int, chunks: int) -> list[str]:
    problems = []
    if sorted(schedule) != list(range(pp)):
        problems.append(f"ranks are {sorted(schedule)}, expected 0..{pp - 1}")
    for r, actions in schedule.items():
        for i, a in enumerate(actions):
            if not (0 <= a.stage < pp * chunks and 0 <= a.microbatch < m):
                problems.append(f"rank {r} action {i} {a}: stage must be < {pp * chunks} "
                                f"and micro-batch < {m}")
            elif rank_of(a.stage, pp) != r:
                problems.append(f"rank {r} action {i} {a}: stage {a.stage} lives on rank "
                                f"{rank_of(a.stage, pp)}")
    return problems


def _index(schedule) -> dict[Action, list[tuple[int, int]]]:
    """Every (rank, position) each distinct action appears at."""
    where: dict[Action, list[tuple[int, int]]] = defaultdict(list)
    for r, actions in schedule.items():
        for i, a in enumerate(actions):
            where[a].append((r, i))
    return where


def _compute(where, pp: int, m: int, chunks: int) -> list[str]:
    """Rules 2 and 3."""
    problems = []
    last = pp * chunks - 1

    def needs(first: Action, then: Action, what: str) -> None:
        # Both actions sit on one rank (placement was checked), so list order is
        # time order. Duplicates are reported once, by the count check below.
        firsts, thens = where.get(first, ()), where.get(then, ())
        if len(thens) != 1 or len(firsts) > 1:
            return
        if not firsts:
            problems.append(f"{then} needs {first}, which is missing: {what}")
        elif firsts[0][1] > thens[0][1]:
            problems.append(f"{then} on rank {thens[0][0]} runs before {first}: {what}")

    for s in range(last + 1):
        for mb in range(m):
            for kind in (K.F, K.B):
                n = len(where.get(Action(s, kind, mb), ()))
                if n != 1:
                    problems.append(f"{Action(s, kind, mb)} appears {n} times, expected once")
            fwd, bwd = Action(s, K.F, mb), Action(s, K.B, mb)
            needs(fwd, bwd, "backward needs its forward")
            for prev, nxt, kind, send, recv in ((s - 1, s, K.F, K.SEND_F, K.RECV_F),
                                                (s + 1, s, K.B, K.SEND_B, K.RECV_B)):
                if not 0 <= prev <= last:
                    continue
                producer, consumer = Action(prev, kind, mb), Action(nxt, kind, mb)
                if rank_of(prev, pp) == rank_of(nxt, pp):
                    needs(producer, consumer, "same-rank dependency")
                else:
                    needs(producer, Action(prev, send, mb), "send after compute")
                    needs(Action(nxt, recv, mb), consumer, "receive before compute")
    return problems


def _pairs(schedule, pp: int, chunks: int) -> list[str]:
    """Rule 4: one-to-one matching and equal order per ordered rank pair."""
    problems = []
    sends: dict[tuple, list[Action]] = defaultdict(list)  # message -> its SEND actions
    recvs: dict[tuple, list[Action]] = defaultdict(list)
    order_sent: dict[tuple[int, int], list] = defaultdict(list)
    order_recv: dict[tuple[int, int], list] = defaultdict(list)
    for r, actions in schedule.items():
        for a in actions:
            if a.kind.is_compute:
                continue
            msg = message_of(a)
            sender, receiver = msg[1], msg[1] + (1 if msg[0] == "F" else -1)
            src, dst = rank_of(sender, pp), rank_of(receiver, pp)
            if not 0 <= receiver < pp * chunks or src == dst:
                problems.append(f"{a} on rank {r}: no peer stage on another rank to "
                                f"{'send to' if a.kind.is_send else 'receive from'}")
                continue
            (sends if a.kind.is_send else recvs)[msg].append(a)
            (order_sent if a.kind.is_send else order_recv)[(src, dst)].append(msg)
    for msg in sends.keys() | recvs.keys():
        ns, nr = len(sends.get(msg, ())), len(recvs.get(msg, ()))
        if ns != 1 or nr != 1:
            shown = (sends.get(msg) or recvs.get(msg))[0]
            problems.append(f"message of {shown} has {ns} send(s) and {nr} receive(s), "
                            f"expected one each")
    if not problems:
        for pair in order_sent.keys() | order_recv.keys():
            if order_sent[pair] != order_recv[pair]:
                first = next(i for i, (x, y) in enumerate(zip(order_sent[pair], order_recv[pair]))
                             if x != y)
                problems.append(f"rank {pair[0]} -> rank {pair[1]}: message {first} is sent as "
                                f"{order_sent[pair][first]} but received as "
                                f"{order_recv[pair][first]} (direction, sending stage, mb)")
    return problems


def _dry_run(schedule) -> list[str]:
    """Rule 5: replay with zero costs; a rank left behind is blocked forever."""
    _, stuck = replay(schedule, lambda a: 0.0)
    return [f"deadlock: rank {r} waits forever at action {i} ({schedule[r][i]})"
            for r, i in sorted(stuck.items())]


def validate(schedule: Mapping[int, Sequence[Action]], pp: int, m: int, chunks: int = 1, *,
             nccl: bool = False) -> None:
    """Check every rule in the module docstring; raise `ScheduleError` listing all that fail.

    The message ends with the step x rank table of the schedule. The dry run is
    only attempted once the structural rules pass, so its report is not noise.
    """
    problems = _placement(schedule, pp, m, chunks)
    if not problems:
        problems = _compute(_index(schedule), pp, m, chunks) + _pairs(schedule, pp, chunks)
    if not problems:
        problems = _dry_run(schedule)
    if not problems and nccl:
        problems = nccl_problems(schedule, pp, chunks)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise ScheduleError(f"invalid pipeline schedule (pp={pp}, chunks={chunks}, "
                            f"microbatches={m}), {len(problems)} problem(s):\n{listed}{more}\n"
                            f"{format_table(schedule)}")
