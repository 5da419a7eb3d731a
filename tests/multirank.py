"""spawn(): run a function on N CPU ranks with gloo and re-raise any rank's failure.

file:// rendezvous under a temporary directory (no port races), one thread per
rank (CI has 2 cores), and a process-group timeout short enough that a hang fails
the test instead of stalling CI.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)


def _worker(rank: int, world: int, init_file: str, errors, fn, args, group: bool = True):
    faulthandler.enable()  # a native abort (SIGABRT, SIGSEGV) prints every thread's Python stack
    torch.set_num_threads(1)
    try:
        if not group:  # fn makes its own process groups (megaft.launch.rank.run_rank per run)
            fn(rank, world, *args)
        else:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world, timeout=TIMEOUT)
            try:
                fn(rank, world, *args)
                dist.barrier()  # no rank tears its group down while a peer may still have traffic in flight
            finally:
                dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    # A rank once died of SIGABRT in CI with no Python error (tests/models/test_arch.py, pp=2). If
    # that was interpreter finalization (C++ static destructors racing gloo's threads), exiting
    # here skips it; if not, faulthandler above prints where it was.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, fn, *args, group: bool = True) -> None:
    """Run fn(rank, world, *args) on `world` gloo ranks; fn must be importable (top level).
    group=False: no process group around fn (it starts its own, e.g. one per training run)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.start_processes(_worker, args=(world, init_file, errors, fn, args, group), nprocs=world,
                               join=True, start_method="spawn")
        except Exception as exc:
            reports = []
            while not errors.empty():
                rank, tb = errors.get()
                reports.append(f"--- rank {rank} ---\n{tb}")
            raise AssertionError("multi-rank test failed:\n" + "\n".join(reports)) from exc
