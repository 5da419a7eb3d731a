"""megaft.forks: fork_map's results, errors and children (the planner's search runs on it)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from megaft.forks import deal, fork_map, undeal


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_results_in_order_from_distinct_processes():
    out = fork_map(lambda chunk: (os.getpid(), [x * x for x in chunk]), [[1, 2], [3], [], [4, 5, 6]])
    assert [squares for _, squares in out] == [[1, 4], [9], [], [16, 25, 36]]
    pids = [pid for pid, _ in out]
    assert pids[0] == os.getpid() and len(set(pids)) == 4  # the first chunk here, one child per other
    assert all(_gone(pid) for pid in pids[1:])  # reaped


def test_a_childs_exception_is_raised_with_its_traceback_and_no_child_is_left(tmp_path):
    slow = tmp_path / "slow.pid"

    def work(chunk):
        if chunk == "here":  # wait until the slow child runs, so that it is alive when the error comes
            while not slow.exists():
                time.sleep(0.01)
            return 0
        if chunk == "fail":
            raise ValueError("bad layout 7")
        slow.write_text(str(os.getpid()))
        time.sleep(60)

    with pytest.raises(RuntimeError, match="(?s)worker process failed.*ValueError: bad layout 7"):
        fork_map(work, ["here", "fail", "slow"])
    assert _gone(int(slow.read_text()))  # killed and reaped, not left sleeping


def test_a_child_that_dies_is_an_error():
    def work(chunk):
        if chunk:
            os.kill(os.getpid(), signal.SIGKILL)
        return chunk

    with pytest.raises(RuntimeError, match="died before it answered"):
        fork_map(work, [0, 1])


@pytest.mark.parametrize("n, parts", [(0, 3), (1, 3), (7, 1), (7, 3), (9, 3), (5, 8)])
def test_deal_and_undeal(n, parts):
    hands = deal(list(range(n)), parts)
    assert len(hands) == max(1, min(parts, n)) and max(map(len, hands)) - min(map(len, hands)) <= 1
    assert undeal(hands) == list(range(n))
