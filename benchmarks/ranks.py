"""Benchmarks on CPU ranks: `on_gloo_ranks(world, fn, *args)` runs fn(rank, world, *args) in
`world` spawned processes joined in one gloo process group (file rendezvous, one thread
per rank, a timeout so a hang fails instead of stalling) and returns rank 0's result."""
from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)


def _entry(rank: int, world: int, init_file: str, out, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            out.put(result)
        dist.barrier()  # no rank tears its group down while another still has work in flight
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(world: int, fn, *args):
    """fn(rank, world, *args) on `world` gloo ranks (fn importable: top level of a module);
    what rank 0's call returned."""
    out = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "rdzv"), out, fn, args), nprocs=world,
                           join=True, start_method="spawn")
    return out.get()
