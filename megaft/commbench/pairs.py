"""The node-pair matrix: point-to-point bandwidth of every ordered pair of hosts, one pair at
a time, and the links far below the median.

One rank per host (its first) stands for the host. For each ordered pair (a, b) in turn,
with every other rank waiting at a world all-reduce, a's rank sends `nbytes` to b's rank,
which checks the payload and answers with a 1-element acknowledgement; a times send to
acknowledgement. Both directions are measured, since a bad NIC or cable often shows in
one only. A pair is slow when its bandwidth is below `fraction` x the median of all pairs.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from megaft.commbench.groups import ranks_by_host
from megaft.commbench.hooks import Hooks
from megaft.commbench.measure import SENTINEL, mismatch, pattern, sync


def _one_pair(src: int, dst: int, numel: int, device: torch.device, hooks: Hooks, warmup: int,
              repeats: int) -> tuple[list[float], Optional[str]]:
    """Run the (src -> dst) measurement on the rank that is src or dst."""
    rank, base = dist.get_rank(), pattern(numel, device)
    buf, ack = torch.empty(numel, device=device), torch.zeros(1, device=device)
    times, error = [], None
    for k in range(warmup + repeats):
        if rank == src:
            buf.copy_(base).add_(64 * (k % 64))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            delay = hooks.delay(src, dst)
            if delay:
                time.sleep(delay)
            dist.send(buf, dst)
            dist.recv(ack, dst)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
        else:
            buf.fill_(SENTINEL)
            dist.recv(buf, src)
            if hooks.corrupt:
                hooks.corrupt("send_recv", rank, buf)
            err = mismatch(buf, base + 64 * (k % 64))
            if err and error is None:
                error = f"iteration {k}: {err}"
            dist.send(ack, src)
    return times, error


def measure_pairs(hosts: list[str], nbytes: int, device: torch.device, hooks: Hooks, *, warmup: int,
                  repeats: int) -> list[dict]:
    """This rank's records of every ordered host pair it took part in (every rank calls this)."""
    leaders = {host: ranks[0] for host, ranks in ranks_by_host(hosts).items()}
    rank, numel, records = dist.get_rank(), max(nbytes // 4, 1), []
    for a, ra in leaders.items():
        for b, rb in leaders.items():
            if a == b:
                continue
            sync(None, device)  # everyone else idles while this pair measures
            if rank in (ra, rb):
                times, error = _one_pair(ra, rb, numel, device, hooks, warmup, repeats)
                records.append({"src": a, "dst": b, "bytes": numel * 4, "times": times, "error": error})
    sync(None, device)
    return records


def slow_pairs(gbps: dict[tuple[str, str], float], fraction: float) -> tuple[Optional[float], list[dict]]:
    """(median pair bandwidth, the pairs below fraction x median, slowest first); each slow pair
    is {"src", "dst", "gbps", "ratio"} with ratio = its bandwidth / the median."""
    if not gbps:
        return None, []
    median = statistics.median(gbps.values())
    slow = [{"src": a, "dst": b, "gbps": v, "ratio": v / median} for (a, b), v in gbps.items()
            if v < fraction * median]
    return median, sorted(slow, key=lambda s: s["ratio"])
