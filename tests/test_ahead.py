"""megaft.data.ahead.Ahead: make(step) for any order of steps, the next one made on a thread."""
from __future__ import annotations

import threading

import pytest

from megaft.data.ahead import Ahead


def test_every_step_is_make_of_that_step_in_any_order():
    threads, calls = set(), []

    def make(step):
        threads.add(threading.current_thread().name)
        calls.append(step)
        if step == 7:
            raise ValueError("step 7")
        return ("batch", step)

    ahead = Ahead(make)
    for step in (0, 1, 2, 5, 5, 3):  # in order, a jump (a resume), the same step again, back
        assert ahead(step) == ("batch", step)
    assert ahead(4) == ("batch", 4)
    assert calls[:3] == [0, 1, 2]  # 1 and 2 were made ahead, on the thread
    assert any(name.startswith("megaft-batch") for name in threads)
    assert ahead(6) == ("batch", 6)  # step 7 fails ahead, silently until asked for
    with pytest.raises(ValueError, match="step 7"):
        ahead(7)
