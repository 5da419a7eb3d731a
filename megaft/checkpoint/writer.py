"""CheckpointWriter: synchronous saves, or `train.async_save` shards written by a background thread.

Async protocol (the thread never touches a collective, so it cannot interleave with
the training step's):
1. `save()` in the main thread, on every rank: finish any save still in flight
   (`finish`), copy the state (a CPU run's capture aliases the live buffers), make
   `step_N.tmp/` (one barrier), then start a thread that writes this rank's shard.
2. `unfinished()` is this rank's vote in the step-boundary collective
   (megaft.training.stop.StepBoundary): once the MAX over ranks is 0, every shard
   is on disk and `all_written()` lets rank 0 write the manifest and publish.
3. `finish()` (next save, end of run, preemption) waits for this rank's thread,
   then one barrier, then rank 0 publishes: a run that ends always finalizes.
A crash before publish leaves only `step_N.tmp/`, which readers ignore.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from megaft.checkpoint import io
from megaft.checkpoint import state as ckpt_state
from megaft.parallel.grid import ParallelGrid


def _own_copy(obj: Any) -> Any:
    """Tensors cloned (nested dicts/lists), so training can go on while the copy is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _own_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_own_copy(v) for v in obj)
    return obj


class _Pending:
    def __init__(self, step: int, tmp: str, state: dict[str, Any], rank: int):
        self.step, self.tmp, self.error = step, tmp, None
        self.thread = threading.Thread(target=self._write, args=(state, rank), name=f"megaft-save-{step}",
                                       daemon=True)
        self.thread.start()

    def _write(self, state: dict[str, Any], rank: int) -> None:
        try:
            ckpt_state.write_shard(self.tmp, state, rank)
        except BaseException as exc:  # re-raised in the main thread by wait()
            self.error = exc

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"writing checkpoint shard of step {self.step} into {self.tmp} failed: "
                               f"{self.error}") from self.error


class CheckpointWriter:
    """Saves checkpoints of one rank under `root`, synchronously or in the background."""

    def __init__(self, root: str, grid: ParallelGrid, *, keep_last: int, async_save: bool,
                 meta: Optional[dict[str, Any]] = None):
        """`meta`: extra manifest keys of every checkpoint (the trainer's "model" record).
        Rank 0 removes the `step_N.tmp/` an earlier failed save left (before this run saves)."""
        self.root, self.grid, self.keep_last, self.async_save = root, grid, keep_last, async_save
        self.meta = meta
        self.pending: Optional[_Pending] = None
        if grid.rank == 0:
            io.remove_partial(root)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Every rank calls it at the same step (it holds barriers)."""
        if not self.async_save:
            ckpt_state.save(self.root, step, state, self.grid, keep_last=self.keep_last, meta=self.meta)
            return
        self.finish()  # at most one save in flight
        if self.grid.device.type == "cpu":
            state = _own_copy(state)  # on GPU, capture's .cpu() already copied
        tmp = ckpt_state.prepare(self.root, step, self.grid)
        self.pending = _Pending(step, tmp, state, self.grid.rank)

    def unfinished(self) -> int:
        """1 while this rank's shard is still being written, else 0 (its step-boundary vote)."""
        return int(self.pending is not None and self.pending.thread.is_alive())

    def all_written(self) -> None:
        """Every rank voted 0: all shards are on disk; rank 0 publishes (no collective)."""
        if self.pending is not None:
            self._publish()

    def finish(self) -> None:
        """Wait for the save in flight and publish it; every rank calls it (one barrier)."""
        if self.pending is None:
            return
        self.pending.wait()
        ckpt_state.barrier(self.grid)  # every rank's shard is on disk
        self._publish()
        ckpt_state.barrier(self.grid)  # visible before anyone resumes or exits

    def _publish(self) -> None:
        pending, self.pending = self.pending, None
        pending.wait()  # already finished: surfaces a write error
        if self.grid.rank == 0:
            ckpt_state.publish(self.root, pending.step, pending.tmp, ckpt_state.layout(self.grid),
                               keep_last=self.keep_last, meta=self.meta)
