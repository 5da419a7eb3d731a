"""Ahead: a step's batch made while the step before it trains.

A run's batch is a pure function of its step (megaft.data.batches, megaft.pref.batches), so
`Ahead(make)(step)` returns make(step) and starts make(step + 1) on one background thread;
the next call takes that result if it asks for that step, else makes its own. At most one
make runs at a time (a call waits for the one in flight before making another), so `make`
need not be thread-safe against itself; what it reads must not change under it.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class Ahead(Generic[T]):
    def __init__(self, make: Callable[[int], T]):
        self.make = make
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megaft-batch")
        self._next: Optional[tuple[int, Future]] = None

    def __call__(self, step: int) -> T:
        made = None
        if self._next is not None:
            ahead, future = self._next
            self._next = None
            if ahead == step:
                made = future.result()  # raises what make raised, for the step that asked for it
            else:
                future.exception()  # wait for it (one make at a time) and drop it
        batch = self.make(step) if made is None else made
        self._next = (step + 1, self._pool.submit(self.make, step + 1))
        return batch
