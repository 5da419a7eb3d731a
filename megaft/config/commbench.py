"""CommbenchConfig (`commbench.*`): what `megaft-commbench` measures and what check mode demands.
A config-layer leaf (stdlib only): the root Config composes it, so megaft-train's overrides
(parallel.*, launcher.*, device) place commbench's ranks exactly as training would."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import List

from megaft.config.checks import at_least

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# Largest message when commbench.max_bytes=0. GPUs: nccl-tests' usual 1 GiB, where NVLink
# and InfiniBand reach their plateau. CPU/gloo: 4 MiB keeps a 2-rank run to seconds (gloo
# moves ~1 GB/s over loopback), and the bandwidth of larger CPU messages tells training nothing.
DEFAULT_MAX_BYTES = {"cuda": GIB, "cpu": 4 * MIB}
PAIR_BYTES_CAP = 64 * MIB  # node-pair message when commbench.pair_bytes=0 (min with max_bytes)


class Collective(StrEnum):
    all_reduce = "all_reduce"
    reduce_scatter = "reduce_scatter"
    all_gather = "all_gather"
    all_to_all = "all_to_all"
    broadcast = "broadcast"
    send_recv = "send_recv"  # every rank sends to the next of its group and receives from the previous


class EpCollective(StrEnum):
    """Expert parallelism's all-to-all over the ep groups at the model's size (megaft.commbench.ep):
    measured when parallel.ep > 1 and all_to_all is among commbench.collectives, never swept."""
    balanced = "ep_all_to_all"  # as many rows to every rank: the routing the cost model prices
    routed = "ep_all_to_all_routed"  # split sizes of a seeded, skewed routing: some ranks send and get more


@dataclass
class CommbenchConfig:
    collectives: List[str] = field(default_factory=lambda: [c.value for c in Collective])  # which to time
    min_bytes: int = 8 * KIB  # smallest message (nccl-tests' size column), doubled up to max_bytes
    max_bytes: int = 0  # largest message; 0 = 1 GiB on GPU, 4 MiB on CPU (gloo)
    warmup: int = 5  # untimed (but checked) iterations per collective and size, as nccl-tests -w 5
    repeats: int = 20  # timed iterations; median and p20/p80 over them (nccl-tests -n 20)
    pairs: bool = True  # node-pair point-to-point matrix (one rank per host; needs >= 2 hosts)
    pair_bytes: int = 0  # message of the node-pair matrix; 0 = min(max_bytes, 64 MiB)
    slow_fraction: float = 0.5  # a node pair below this fraction of the median pair bandwidth is named
    check: bool = False  # job-prologue mode: exit 1 naming a slow pair or a collective below min_busbw_gbps
    min_busbw_gbps: float = 0.0  # check: bus bandwidth floor (GB/s = 1e9 B/s) at the largest size; 0 = none
    plot: bool = True  # write commbench.png (matplotlib)


def max_bytes_for(cfg: CommbenchConfig, device_type: str) -> int:
    """The largest message on `device_type` ("cpu" | "cuda")."""
    return cfg.max_bytes or DEFAULT_MAX_BYTES[device_type]


def pair_bytes_for(cfg: CommbenchConfig, device_type: str) -> int:
    return cfg.pair_bytes or min(max_bytes_for(cfg, device_type), PAIR_BYTES_CAP)


def message_sizes(cfg: CommbenchConfig, device_type: str) -> list[int]:
    """min_bytes, 2*min_bytes, ... up to max_bytes (nccl-tests -b MIN -e MAX -f 2)."""
    sizes, size, top = [], cfg.min_bytes, max_bytes_for(cfg, device_type)
    while 0 < size <= top:
        sizes.append(size)
        size *= 2
    return sizes


def check_commbench(cfg: CommbenchConfig, device_type: str) -> list[str]:
    """Every problem of `commbench.*` for ranks computing on `device_type`, each with its fix."""
    problems = []
    unknown = [c for c in cfg.collectives if c not in set(Collective)]
    if unknown or not cfg.collectives:
        problems.append(f"commbench.collectives={list(cfg.collectives)} must be a non-empty list of "
                        f"{', '.join(Collective)}; fix: e.g. commbench.collectives=[all_reduce,all_gather]")
    problems += at_least(cfg, "commbench.min_bytes", 4, "(one float32)", "e.g. 8192")
    problems += at_least(cfg, "commbench.max_bytes", 0, "(0 = by device)", "e.g. 4194304")
    if cfg.max_bytes >= 0 and cfg.min_bytes >= 4 and cfg.min_bytes > max_bytes_for(cfg, device_type):
        problems.append(f"commbench.min_bytes={cfg.min_bytes} > the largest size {max_bytes_for(cfg, device_type)} "
                        f"on {device_type}; fix: lower min_bytes or raise commbench.max_bytes")
    problems += at_least(cfg, "commbench.pair_bytes", 0, "(0 = min(max_bytes, 64 MiB))")
    problems += at_least(cfg, "commbench.warmup", 0, fix="e.g. commbench.warmup=5")
    problems += at_least(cfg, "commbench.repeats", 1, fix="e.g. commbench.repeats=20")
    if not 0 < cfg.slow_fraction <= 1:
        problems.append(f"commbench.slow_fraction={cfg.slow_fraction} must be in (0, 1]; fix: e.g. 0.5")
    problems += at_least(cfg, "commbench.min_busbw_gbps", 0, "(0 = no floor)")
    return problems
