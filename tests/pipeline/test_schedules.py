"""Schedules as data: actions, builders, CSV files and the validator, without processes."""
from __future__ import annotations

import pytest

from megaft.pipeline import (
    Action,
    ActionKind,
    ScheduleError,
    add_send_recv,
    build_schedule,
    chunk_of,
    dump_schedule,
    format_table,
    gpipe,
    interleaved_1f1b,
    load_schedule,
    one_f_one_b,
    parse_action,
    peak_in_flight,
    rank_of,
    validate,
)

K = ActionKind


def all_cases(max_pp=4, max_chunks=3, max_m=12):
    """Every (name, pp, chunks, m) the builders accept within the bounds."""
    for pp in range(1, max_pp + 1):
        for m in range(1, max_m + 1):
            yield "gpipe", pp, 1, m
            yield "1f1b", pp, 1, m
            if m % pp == 0:
                for chunks in range(1, max_chunks + 1):
                    yield "interleaved", pp, chunks, m


CASES = list(all_cases())


# --- actions -----------------------------------------------------------------

@pytest.mark.parametrize("text, action", [
    ("2F0", Action(2, K.F, 0)), ("0B11", Action(0, K.B, 11)),
    ("1SEND_F3", Action(1, K.SEND_F, 3)), ("12RECV_B7", Action(12, K.RECV_B, 7)),
    ("3RECV_F0", Action(3, K.RECV_F, 0)), ("4SEND_B2", Action(4, K.SEND_B, 2)),
])
def test_action_string_round_trip(text, action):
    assert parse_action(text) == action
    assert str(action) == text == repr(action)
    assert parse_action(f"  {text} ") == action


def test_every_action_of_every_schedule_round_trips():
    for name, pp, chunks, m in CASES[::7]:
        for actions in build_schedule(name, pp, m, chunks).values():
            assert [parse_action(str(a)) for a in actions] == actions


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "-1F0", "1SEND0", "1f0"])
def test_parse_action_rejects_garbage(bad):
    with pytest.raises(ScheduleError, match="cannot parse action"):
        parse_action(bad)


def test_virtual_stage_placement_is_megatron_interleaving():
    # pp=4: rank 1 holds chunks at virtual stages 1, 5, 9.
    assert [rank_of(s, 4) for s in (1, 5, 9)] == [1, 1, 1]
    assert [chunk_of(s, 4) for s in (1, 5, 9)] == [0, 1, 2]


# --- builders ------------------------------------------------------------------

@pytest.mark.parametrize("name, pp, chunks, m", CASES)
def test_every_built_schedule_validates(name, pp, chunks, m):
    validate(build_schedule(name, pp, m, chunks), pp, m, chunks)


def test_send_recv_placement():
    sched = one_f_one_b(2, 2)
    assert [str(a) for a in sched[0]] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
    assert [str(a) for a in sched[1]] == [
        "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]
    # Each compute action is wrapped by exactly the receive before and the send after.
    for rank, actions in interleaved_1f1b(2, 2, 4).items():
        for i, a in enumerate(actions):
            if a.kind.is_recv:
                nxt = actions[i + 1]
                assert nxt.kind is (K.F if a.kind is K.RECV_F else K.B)
                assert (nxt.stage, nxt.microbatch) == (a.stage, a.microbatch)


def test_pp1_has_no_communication_even_with_chunks():
    for sched in (gpipe(1, 3), one_f_one_b(1, 3), interleaved_1f1b(1, 3, 4)):
        assert all(a.kind.is_compute for a in sched[0])


def test_one_f_one_b_order():
    sched = one_f_one_b(4, 8)
    compute = [str(a) for a in sched[0] if a.kind.is_compute]
    assert compute[:5] == ["0F0", "0F1", "0F2", "0F3", "0B0"]
    last = [str(a) for a in sched[3] if a.kind.is_compute]
    assert last[:4] == ["3F0", "3B0", "3F1", "3B1"]


def test_interleaved_order_follows_megatron():
    # pp=2, 2 chunks, m=4: rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards,
    # micro-batches in groups of pp=2 per chunk.
    compute = [str(a) for a in interleaved_1f1b(2, 2, 4)[0] if a.kind.is_compute]
    assert compute[:6] == ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0"]
    # backward walks the chunks last-to-first
    assert compute[-4:] == ["2B2", "2B3", "0B2", "0B3"]


@pytest.mark.parametrize("pp, m", [(2, 3), (4, 6), (4, 2), (3, 4)])
def test_interleaved_needs_multiple_of_pp(pp, m):
    with pytest.raises(ValueError, match=r"multiple of pp.*num_microbatches=\d+"):
        interleaved_1f1b(pp, 2, m)
    with pytest.raises(ValueError, match="multiple of pp"):
        build_schedule("interleaved", pp, m, chunks=2)


def test_build_schedule_errors():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'.*gpipe, 1f1b, interleaved"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match="one model chunk per rank.*interleaved"):
        build_schedule("1f1b", 2, 4, chunks=2)
    with pytest.raises(ValueError, match="pp must be a positive integer"):
        build_schedule("gpipe", 0, 4)
    with pytest.raises(ValueError, match="num_microbatches must be"):
        one_f_one_b(2, 0)


# --- memory bounds ---------------------------------------------------------------

@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_peak_in_flight_bounds(pp, m):
    peaks_1f1b = peak_in_flight(one_f_one_b(pp, m))
    assert peaks_1f1b[0] == min(pp, m)  # 1F1B's promise: at most pp on the first stage
    assert all(peaks_1f1b[r] == min(pp - r, m) for r in range(pp))
    assert peak_in_flight(gpipe(pp, m)) == {r: m for r in range(pp)}  # GPipe keeps all of them


@pytest.mark.parametrize("pp, chunks, m", [(2, 2, 4), (4, 2, 8), (4, 3, 16), (4, 2, 4)])
def test_peak_in_flight_interleaved(pp, chunks, m):
    warmup = (pp - 1) * 2 + (chunks - 1) * pp
    assert peak_in_flight(interleaved_1f1b(pp, chunks, m))[0] == min(warmup + 1, m * chunks)


# --- CSV -----------------------------------------------------------------------

@pytest.mark.parametrize("name, pp, chunks, m", [("1f1b", 4, 1, 8), ("interleaved", 2, 3, 6),
                                                  ("gpipe", 1, 1, 2)])
def test_csv_round_trip(tmp_path, name, pp, chunks, m):
    sched = build_schedule(name, pp, m, chunks)
    path = tmp_path / "sched.csv"
    dump_schedule(sched, path)
    assert path.read_text().splitlines()[0].startswith(",".join(str(a) for a in sched[0][:2]))
    assert load_schedule(path) == sched


def test_compute_only_csv_gets_communication(tmp_path):
    # torch's compute-only CSVs may have empty (idle) cells; they are skipped.
    path = tmp_path / "custom.csv"
    path.write_text("0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n")
    sched = add_send_recv(load_schedule(path), pp=2)
    validate(sched, 2, 2)
    assert sched == one_f_one_b(2, 2)


def test_csv_parse_error_names_the_row(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Q0\n")
    with pytest.raises(ScheduleError, match=r"row 2 \(rank 1\).*'1Q0'"):
        load_schedule(path)


# --- the validator catches broken schedules ----------------------------------------

def rejects(sched, pp, m, chunks=1, match=""):
    """validate raises, names the problem, and shows the table."""
    with pytest.raises(ScheduleError, match=match) as err:
        validate(sched, pp, m, chunks)
    assert format_table(sched) in str(err.value)
    return str(err.value)


def test_dropped_backward_is_reported():
    sched = one_f_one_b(2, 4)
    sched[0].remove(Action(0, K.B, 2))
    rejects(sched, 2, 4, match="0B2 appears 0 times")


def test_dropped_send_is_reported():
    sched = gpipe(3, 2)
    sched[1].remove(Action(1, K.SEND_F, 1))
    rejects(sched, 3, 2, match="0 send")


def test_dropped_receive_is_reported():
    sched = gpipe(3, 2)
    sched[2].remove(Action(2, K.RECV_F, 0))
    msg = rejects(sched, 3, 2, match=r"2F0 needs 2RECV_F0, which is missing")
    assert "1 send(s) and 0 receive(s)" in msg


def test_duplicated_forward_is_reported():
    sched = interleaved_1f1b(2, 2, 4)
    sched[1].insert(5, Action(3, K.F, 0))
    rejects(sched, 2, 4, 2, match="3F0 appears 2 times")


def test_swap_that_deadlocks_is_reported():
    # Rank 0 waits for mb 0's gradient before sending mb 0's activations.
    sched = one_f_one_b(2, 1)
    assert sched[0][1:3] == [Action(0, K.SEND_F, 0), Action(0, K.RECV_B, 0)]
    sched[0][1], sched[0][2] = sched[0][2], sched[0][1]
    rejects(sched, 2, 1, match=r"deadlock: rank 0 waits forever at action 1 \(0RECV_B0\)")


# Rank 0 receives nothing else from rank 1 before its first gradient unless pp == 2
# with several chunks (then activations of chunk 1 also come from rank 1, and the
# hoist below would be caught as a reordering instead).
DEADLOCK_CASES = [c for c in CASES if c[1] > 2 or (c[1] == 2 and c[2] == 1)][::4]


@pytest.mark.parametrize("name, pp, chunks, m", DEADLOCK_CASES)
def test_hoisted_receive_deadlocks_everywhere(name, pp, chunks, m):
    # Same mutation on every multi-rank schedule: rank 0 waits for its first gradient
    # before doing anything, but that gradient needs rank 0's first forward.
    sched = build_schedule(name, pp, m, chunks)
    first = next(a for a in sched[0] if a.kind is K.RECV_B)
    sched[0].remove(first)
    sched[0].insert(0, first)
    rejects(sched, pp, m, chunks, match=rf"deadlock: rank 0 waits forever at action 0 \({first}\)")


def test_backward_before_forward_is_reported():
    sched = one_f_one_b(1, 2)
    sched[0][0], sched[0][1] = sched[0][1], sched[0][0]  # 0B0 before 0F0
    rejects(sched, 1, 2, match="0B0 on rank 0 runs before 0F0")


def test_send_order_mismatch_is_reported():
    # Swapping two forwards on rank 0 keeps every dependency but reorders its sends,
    # which NCCL would deliver to the wrong receive.
    sched = gpipe(2, 3)
    a, b = sched[0].index(Action(0, K.F, 0)), sched[0].index(Action(0, K.F, 1))
    sched[0][a:a + 2], sched[0][b:b + 2] = sched[0][b:b + 2], sched[0][a:a + 2]
    rejects(sched, 2, 3, match=r"rank 0 -> rank 1: message 0 is sent as \('F', 0, 1\)")


def test_wrong_rank_and_range_are_reported():
    sched = one_f_one_b(2, 2)
    sched[0].append(Action(1, K.F, 0))
    sched[1].append(Action(1, K.F, 9))
    msg = rejects(sched, 2, 2, match="stage 1 lives on rank 1")
    assert "micro-batch < 2" in msg


def test_format_table_lists_compute_by_step():
    table = format_table(one_f_one_b(2, 2))
    assert table.splitlines() == [
        "        Rank 0 Rank 1",
        "Step 0: 0F0    1F0",
        "Step 1: 0F1    1B0",
        "Step 2: 0B0    1F1",
        "Step 3: 0B1    1B1",
    ]


# --- NCCL rendezvous dry run (validate rule 6) ------------------------------------

@pytest.mark.parametrize("name, pp, chunks, m", CASES)
def test_every_built_schedule_is_nccl_safe(name, pp, chunks, m):
    """The runtime's plan for every built schedule cannot hang under NCCL's rendezvous."""
    validate(build_schedule(name, pp, m, chunks), pp, m, chunks, nccl=True)


def test_plan_posts_receives_early_where_plain_batches_hang():
    from megaft.pipeline.comm_plan import comm_batches, nccl_problems, plan, rendezvous

    # Interleaved, pp=2, v=2, m=4: plainly batched, rank 0 posts [2SEND_B0] alone
    # while rank 1's batch [3SEND_B1, 1RECV_F2] waits for a receive rank 0 posts only
    # in its next batch (fine on gloo's tags and buffered sends, a hang on NCCL).
    sched = build_schedule("interleaved", 2, 4, 2)
    plain = {r: comm_batches(a) for r, a in sched.items()}
    assert set(rendezvous(plain, 2, 2)) == {0, 1}
    planned = plan(sched, 2, 2)
    assert rendezvous(planned, 2, 2) == {} and nccl_problems(sched, 2, 2) == []
    after_2b0 = planned[0][planned[0].index(Action(2, K.B, 0)) + 1]
    assert Action(2, K.RECV_B, 1) in after_2b0  # posted one batch early
    for r in sched:  # same actions, same order of compute, sends and receives
        flat = [a for item in planned[r] for a in (item if isinstance(item, list) else [item])]
        assert sorted(flat, key=str) == sorted(sched[r], key=str)
        for keep in (lambda a: a.kind.is_compute, lambda a: a.kind.is_send, lambda a: a.kind.is_recv):
            assert [a for a in flat if keep(a)] == [a for a in sched[r] if keep(a)]
    # A hand-made plan that crosses two batches is reported.
    crossed = {0: [[Action(0, K.SEND_F, 0)], Action(0, K.F, 1), [Action(0, K.RECV_B, 0)]],
               1: [[Action(1, K.SEND_B, 0)], Action(1, K.F, 2), [Action(1, K.RECV_F, 0)]]}
    assert set(rendezvous(crossed, 2, 1)) == {0, 1}
