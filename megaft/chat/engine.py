"""Engines answer one prompt at a time, calling `on_token(id)` as each id is chosen:
`LocalEngine` runs the model in this process; `RanksEngine` runs it tensor-parallel over
`launcher.nproc` local ranks.

With ranks, this process keeps the terminal (a spawned rank has no stdin, and the ranks
leave the terminal's process group, as megaft-train's do, so Ctrl-C reaches only this
process). Every request goes to every rank through its own queue, so all ranks run the
same `generate` call (its draws are seeded identically on every tp rank); rank 0 sends the
ids back one by one as it keeps them, then "done". A rank that fails reports its error;
one that dies ends the chat with its exit code.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import tempfile
import traceback
from typing import Callable

import torch

from megaft.chat.load import ChatError, ChatModel, build_model, compute, max_seq_len
from megaft.inference.generate import Sampling, generate

OnToken = Callable[[int], None]
TIMEOUT_S = 600  # a collective that waits longer than this fails (a rank died or hung)


def _generate(model, ids, pixels, chat: ChatModel, device, sampling, step, max_new_tokens, on_token):
    """The answer's new ids: a text model's `generate`, or with `pixels` (a vision-language model)
    megaft.inference.vision's."""
    if pixels is None:
        return generate(model, [ids], max_new_tokens=max_new_tokens, eos_id=chat.stop_ids, device=device,
                        sampling=sampling, step=step, on_token=on_token)[0]
    from megaft.inference.vision import generate_with_images

    return generate_with_images(model, ids, pixels, max_new_tokens=max_new_tokens, eos_id=chat.stop_ids,
                                device=device, sampling=sampling, step=step, on_token=on_token)


class RankError(ChatError):
    """A tp rank failed or died (megaft-chat exits 1)."""


class LocalEngine:
    """The model in this process (one rank, no process group)."""

    def __init__(self, chat: ChatModel, device: torch.device):
        self.chat, self.device = chat, device
        self.model = build_model(chat, device=device)
        self.max_len = self.model.cfg.max_seq_len

    def answer(self, ids: list[int], sampling: Sampling, step: int, max_new_tokens: int,
               on_token: OnToken, pixels=None) -> list[int]:
        """`pixels`: the images of `ids` (a vision-language model, megaft.chat.image)."""
        with torch.inference_mode(), compute(self.chat, self.device):
            return _generate(self.model, ids, pixels, self.chat, self.device, sampling, step, max_new_tokens,
                             lambda _, t: on_token(t))

    def close(self) -> None:
        pass


def _rank_main(rank: int, nproc: int, init_file: str, chat: ChatModel, device_setting: str, requests, replies) -> None:
    """One tp rank: load its slice of the model, then answer each request until None."""
    import torch.distributed as dist

    from megaft.launch.local import _detach
    from megaft.launch.rank import pick_device
    from megaft.parallel.grid import ParallelGrid

    _detach()  # out of the terminal's process group; dies with the parent
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        device = pick_device(device_setting, rank)
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init_file}",
                                rank=rank, world_size=nproc, timeout=timeout)
        grid = ParallelGrid.build(tp=nproc, dp=1, pp=1, device=device, timeout=timeout)
        model = build_model(chat, tp_rank=rank, tp_size=nproc, group=grid.tp_group, device=device)
        replies.put(("ready", rank))
        send = (lambda _, token: replies.put(("token", token))) if rank == 0 else None
        while (request := requests.get()) is not None:
            ids, sampling, step, max_new_tokens, pixels = request
            with torch.inference_mode(), compute(chat, device):
                _generate(model, ids, pixels, chat, device, sampling, step, max_new_tokens, send)
            if rank == 0:
                replies.put(("done", rank))
    except Exception as exc:  # reported by the parent (RankError); no traceback on the terminal
        replies.put(("error", rank, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RanksEngine:
    """The model tensor-parallel over `nproc` spawned local ranks (module docstring)."""

    def __init__(self, chat: ChatModel, nproc: int, device_setting: str):
        self.max_len = max_seq_len(chat)
        ctx = multiprocessing.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="megaft-chat-rdzv-")
        init_file = os.path.join(self._tmp.name, "init")
        self.requests = [ctx.Queue() for _ in range(nproc)]
        self.replies = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, name=f"megaft-chat-rank-{r}",
                                  args=(r, nproc, init_file, chat, device_setting, self.requests[r], self.replies))
                      for r in range(nproc)]
        for p in self.procs:
            p.start()
        ready = 0
        while ready < nproc:  # every rank loaded its slice
            if self._next()[0] == "ready":
                ready += 1

    def _next(self) -> tuple:
        """The next reply; ChatError when a rank reported an error or died."""
        while True:
            try:
                reply = self.replies.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    self.close()
                    rank, code = dead[0]
                    raise RankError(f"rank {rank} of {len(self.procs)} exited with code {code}") from None
                continue
            if reply[0] == "error":
                self.close()
                raise RankError(f"rank {reply[1]} of {len(self.procs)} failed: {reply[2]}")
            return reply

    def answer(self, ids: list[int], sampling: Sampling, step: int, max_new_tokens: int,
               on_token: OnToken, pixels=None) -> list[int]:
        for q in self.requests:
            q.put((ids, sampling, step, max_new_tokens, pixels))
        out, interrupted = [], False
        while True:
            try:
                kind, value = self._next()
                if kind == "done":
                    break
                out.append(value)
                if not interrupted:
                    on_token(value)
            except KeyboardInterrupt:  # the ranks finish this answer unseen; then the caller hears of it
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt
        return out

    def close(self) -> None:
        """Stop the ranks (those stuck beside a failed one are killed after 5 s); idempotent."""
        for q, p in zip(self.requests, self.procs):
            if p.exitcode is None:
                q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.exitcode is None:
                p.kill()
                p.join()
        self._tmp.cleanup()
