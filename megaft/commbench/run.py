"""A rank of `megaft-commbench`: process group, the grid a training run would build, the
measurements, and (rank 0) the files. Every rank ends with the whole document."""
from __future__ import annotations

import dataclasses
import os
import platform
import time
from typing import Optional

import torch
import torch.distributed as dist

from megaft.commbench.ep import annotate, ep_plan, measures_ep, model_time
from megaft.commbench.groups import build_scopes, gather_hosts, ranks_by_host
from megaft.commbench.hooks import Hooks
from megaft.commbench.measure import measure_collective, measure_ep, sync
from megaft.commbench.pairs import measure_pairs
from megaft.commbench.report import write_report
from megaft.commbench.results import SCHEMA, collective_rows, pair_table
from megaft.config import Config
from megaft.config.commbench import EpCollective, max_bytes_for, message_sizes, pair_bytes_for
from megaft.launch.env import DistEnv
from megaft.launch.rank import process_group
from megaft.parallel.grid import ParallelGrid


def _gather(records: list[dict]) -> list[dict]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    return [r for rank_records in everyone for r in rank_records]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"


def bench(cfg: Config, grid: ParallelGrid, hooks: Hooks = Hooks()) -> dict:
    """Measure every scope and the node pairs; the commbench.json document (on every rank).
    torch.distributed must be initialized and `grid` built over it."""
    cb, device, rank = cfg.commbench, grid.device, grid.rank
    hosts = gather_hosts(hooks)
    scopes = build_scopes(grid, hosts)
    plan = ep_plan(cfg) if measures_ep(cfg) else None
    records = []
    for scope in scopes:
        sync(None, device)  # one scope at a time: the others' traffic would share the links
        if scope.group is None:
            continue
        index = scope.groups.index(scope.members)
        for collective in [] if scope.same_as else cb.collectives:
            for size in message_sizes(cb, device.type):
                rec = measure_collective(collective, size, scope.group, scope.members, device, hooks,
                                         warmup=cb.warmup, repeats=cb.repeats)
                records.append(dict(rec, scope=scope.name, group=index, size=size, rank=rank))
        if scope.name == "ep" and plan is not None:  # at the model's size, even when another scope has its groups
            for collective in EpCollective:
                rec = measure_ep(collective.value, plan.splits(collective), plan.row_elems, scope.group,
                                 scope.members, device, hooks, warmup=cb.warmup, repeats=cb.repeats)
                records.append(dict(rec, scope=scope.name, group=index, size=rec["bytes"], rank=rank))
    pair_records = []
    if cb.pairs and len(ranks_by_host(hosts)) > 1:
        pair_records = measure_pairs(hosts, pair_bytes_for(cb, device.type), device, hooks, warmup=cb.warmup,
                                     repeats=cb.repeats)
    described = [s.describe() for s in scopes]
    rows = collective_rows(_gather(records), described)
    ep = {"note": f"parallel.ep={grid.ep_size}: no expert all-to-all to measure" if grid.ep_size == 1 else
          "all_to_all is not in commbench.collectives"}
    if plan is not None:
        model_s, note = model_time(cfg, plan)
        annotate(rows, plan, model_s)
        ep = dict(plan.describe(), model={"time_s": model_s, "note": note})
    config = dict(dataclasses.asdict(cb), max_bytes=max_bytes_for(cb, device.type),
                  pair_bytes=pair_bytes_for(cb, device.type))
    return {
        "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world_size": grid.world_size,
        "backend": grid.backend, "device": device.type, "device_name": _device_name(device), "dtype": "float32",
        "torch": torch.__version__, "hosts": ranks_by_host(hosts),
        "grid": {"tp": grid.tp_size, "cp": grid.cp_size, "dp": grid.dp_size, "pp": grid.pp_size, "ep": grid.ep_size},
        "config": config, "scopes": described, "results": rows, "ep": ep,
        "pairs": pair_table(_gather(pair_records), hosts, pair_bytes_for(cb, device.type), cb.slow_fraction),
    }


def run_rank(cfg: Config, run_dir: str, env: DistEnv, threads: int = 0, hooks: Hooks = Hooks()) -> dict:
    """Initialize the process group of `env`, build the grid, measure; rank 0 writes the files."""
    if threads:
        torch.set_num_threads(threads)
    with process_group(cfg, env, run_dir) as grid:
        doc = bench(cfg, grid, hooks)
        if env.rank == 0:
            write_report(doc, run_dir, plot=cfg.commbench.plot)
        sync(None, grid.device)  # the files exist before any rank returns
    return doc


def local_worker(local_rank: int, cfg: Config, run_dir: str, nproc: int, init_file: str,
                 hooks: Optional[Hooks] = None) -> None:
    """Entry of a rank started by megaft.launch.local.launch_local; bind `hooks` with functools.partial."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    run_rank(cfg, run_dir, DistEnv(local_rank, nproc, local_rank, f"file://{init_file}"), threads, hooks or Hooks())
