"""The simulator against the textbook bubbles, and the timeline plot.

Bubble conventions (see megaft.pipeline.simulate): `bubble_fraction` is idle time
over total time, 1 - C/(p*T); `bubble_ratio` is idle time over ideal time, the
(p-1)/m of Narayanan et al. 2021. With free p2p both formulas are exact for these
schedules; the 1% tolerance is the issue's acceptance bound, not slack we need.
"""
from __future__ import annotations

import pytest

from megaft.pipeline import (
    Action,
    ActionKind,
    Cost,
    ScheduleError,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    rank_of,
    simulate,
)

K = ActionKind
UNIFORM = [Cost(1, 1), Cost(1, 2)]  # F=B, and the usual B = 2F


def close(value, expected):
    """Within 1% of expected (absolute 1e-12 when expected is 0, i.e. pp=1)."""
    return abs(value - expected) <= 0.01 * expected + 1e-12


def pm_grid():
    for p in range(1, 9):
        for m in range(p, 4 * p + 1):
            yield p, m


@pytest.mark.parametrize("cost", UNIFORM, ids=["F=B=1", "F=1,B=2"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_textbook_bubble(name, cost):
    for p, m in pm_grid():
        r = simulate(build_schedule(name, p, m), p, cost)
        assert close(r.bubble_fraction, (p - 1) / (m + p - 1)), (name, p, m, r.bubble_fraction)
        assert close(r.bubble_ratio, (p - 1) / m), (name, p, m, r.bubble_ratio)
        # the whole step is (m + p - 1) forward-backward slots of one stage
        assert r.makespan == pytest.approx((m + p - 1) * (cost.forward + cost.backward))


@pytest.mark.parametrize("fb", [(1, 1), (1, 2)], ids=["F=B", "B=2F"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_interleaved_textbook_bubble(chunks, fb):
    # Each chunk costs 1/v of a rank's work, the premise of (p-1)/(v*m).
    cost = Cost.per_chunk(chunks, *fb)
    for p, m in pm_grid():
        if m % p:
            continue
        r = simulate(interleaved_1f1b(p, chunks, m), p, cost)
        assert close(r.bubble_ratio, (p - 1) / (chunks * m)), (p, chunks, m, r.bubble_ratio)


def test_interleaving_shrinks_the_bubble():
    one = simulate(one_f_one_b(4, 8), 4, Cost.per_chunk(1)).makespan
    two = simulate(interleaved_1f1b(4, 2, 8), 4, Cost.per_chunk(2)).makespan
    assert two < one


def test_timeline_is_consistent_with_costs_and_latency():
    cost = Cost(forward=1.0, backward=2.0, p2p=0.25)
    pp, chunks, m = 4, 2, 8
    r = simulate(interleaved_1f1b(pp, chunks, m), pp, cost)
    end = {}
    for rank, timeline in r.timelines.items():
        for prev, cur in zip(timeline, timeline[1:]):
            assert cur.start == prev.end  # one action at a time, no gaps between list items
        for start, stop, a in timeline:
            expected = {K.F: 1.0, K.B: 2.0}.get(a.kind)
            if expected is not None:
                assert stop - start == expected
                end[a.stage, a.kind, a.microbatch] = stop
    for rank, timeline in r.timelines.items():
        for start, _, a in timeline:
            s, mb = a.stage, a.microbatch
            dep = {K.F: (s - 1, K.F), K.B: (s + 1, K.B)}.get(a.kind)
            if dep and (dep[0], dep[1], mb) in end:
                hop = cost.p2p if rank_of(dep[0], pp) != rank else 0.0
                assert start >= end[dep[0], dep[1], mb] + hop - 1e-9
    assert r.busy == {q: m * chunks * 3.0 for q in range(pp)}
    # latency costs time: more bubble than the free-p2p formula
    assert r.bubble_ratio > (pp - 1) / (chunks * m)


def test_peak_activations_reported():
    r = simulate(gpipe(3, 5), 3)
    assert r.peak_activations == {0: 5, 1: 5, 2: 5}
    r = simulate(one_f_one_b(3, 5), 3)
    assert r.peak_activations == {0: 3, 1: 2, 2: 1}


def test_simulate_reports_deadlock_with_table():
    sched = one_f_one_b(2, 1)
    sched[0].insert(0, sched[0].pop(sched[0].index(Action(0, K.RECV_B, 0))))
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at 0RECV_B0[\s\S]*Rank 0 Rank 1"):
        simulate(sched, 2)


def test_simulate_checks_ranks():
    with pytest.raises(ScheduleError, match="expected 0..2"):
        simulate(one_f_one_b(2, 2), 3)


@pytest.mark.parametrize("width, height, dpi", [(900, 240, 100), (641, 203, 72)])
def test_plot_timeline_writes_png_of_requested_size(tmp_path, width, height, dpi):
    pytest.importorskip("matplotlib", reason="plot_timeline needs matplotlib")
    from matplotlib.image import imread

    from megaft.pipeline.plot import plot_timeline

    r = simulate(interleaved_1f1b(4, 2, 8), 4, Cost.per_chunk(2))
    path = plot_timeline(r, tmp_path / "timeline.png", width=width, height=height, dpi=dpi)
    assert path.stat().st_size > 1000
    image = imread(path)
    assert image.shape[:2] == (height, width)
    assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas


@pytest.mark.parametrize("n", [1, 7])  # Python floats below simulate._NUMPY_FROM settings, arrays above
def test_replay_many_equals_replay_bit_for_bit(n):
    # The planner's batched replay must give the scalar replay's makespan and per-rank compute
    # time exactly (same float operations in the same order), for every schedule and for
    # random per-stage durations and latencies.
    import numpy as np

    from megaft.pipeline.simulate import replay, replay_many

    rng = np.random.default_rng(0)
    cases = [("gpipe", p, m, 1) for p in (2, 3) for m in (1, 4)]
    cases += [("1f1b", p, m, 1) for p in (2, 4) for m in (1, 3, 8)]
    cases += [("interleaved", p, m, v) for p in (2, 4) for v in (2, 3) for m in (p, 2 * p)]
    for name, pp, m, vpp in cases:
        sched = build_schedule(name, pp, m, vpp)
        f, b = rng.random((n, pp * vpp)), 2 * rng.random((n, pp * vpp))
        lat = rng.random(n) * 0.3
        makespan, busy = replay_many(sched, f, b, lat)
        for i in range(n):
            timelines, stuck = replay(sched, lambda a: (f if a.kind is K.F else b)[i][a.stage]
                                      if a.kind.is_compute else 0.0, lat[i])
            assert not stuck
            assert makespan[i] == max(iv.end for tl in timelines.values() for iv in tl), (name, pp, m, vpp)
            assert tuple(busy[i]) == tuple(sum(iv.end - iv.start for iv in timelines[r] if iv.action.kind.is_compute)
                                           for r in range(pp)), (name, pp, m, vpp)


def test_replay_many_reports_a_deadlock():
    import numpy as np

    from megaft.pipeline.simulate import replay_many

    bad = {0: [Action(0, K.RECV_B, 0), Action(0, K.F, 0)], 1: [Action(1, K.RECV_F, 0)]}
    with pytest.raises(ScheduleError, match="deadlock"):
        replay_many(bad, np.ones((1, 2)), np.ones((1, 2)), np.zeros(1))
