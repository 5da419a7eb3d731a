"""`cluster.measured=<megaft-commbench run dir>`: the links the cost model uses, as measured.

megaft-commbench writes commbench.json (schema megaft.commbench/1). Its intra_node scope
(the ranks of each host) and inter_node scope (one rank per host: every NIC busy) time
all-reduces at several sizes. The planner takes, per scope, the bus bandwidth of the
largest correct all-reduce (nccl-tests' busbw: what a ring moves per rank and direction,
the quantity the cost model's ring formulas divide by) and the latency per ring step of
the smallest, time / (2 (n-1)). They replace the datasheet's nvlink_* (intra) and ib_*
(inter) values; a bandwidth is stored divided by cluster.comm_fraction, so that the cost
model's `bandwidth × comm_fraction` is the measured figure. A scope the run did not
measure (one host: no inter_node) keeps the datasheet's values, and says so.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

SCHEMA = "megaft.commbench/1"  # megaft.commbench.results.SCHEMA
LINKS = {"intra_node": ("nvlink_gbps", "nvlink_latency_us"), "inter_node": ("ib_gbps", "ib_latency_us")}


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> dict:
    """The parsed file, read once per version (megaft-plan asks for its links twice)."""
    with open(path) as f:
        return json.load(f)


def commbench_path(measured: str) -> str:
    return os.path.join(measured, "commbench.json") if os.path.isdir(measured) else measured


def measured_links(doc: dict) -> dict[str, dict]:
    """{scope: {gbps, latency_us, bytes, ranks}} for the scopes with correct all-reduce rows."""
    out = {}
    for scope in LINKS:
        rows = sorted((r for r in doc.get("results", []) if r["scope"] == scope and r["collective"] == "all_reduce"
                       and r["correct"] and r["busbw_gbps"]), key=lambda r: r["bytes"])
        if rows:
            big, small = rows[-1], rows[0]
            out[scope] = {"gbps": big["busbw_gbps"], "bytes": big["bytes"], "ranks": big["ranks"],
                          "latency_us": small["time_s"] / (2 * (small["ranks"] - 1)) * 1e6}
    return out


def apply_measured(cluster) -> tuple[object, list[str], list[str]]:
    """(cluster with the measured links, notes, problems) for cluster.measured; unchanged without it."""
    if not cluster.measured:
        return cluster, [], []
    path = commbench_path(cluster.measured)
    fix = "fix: point cluster.measured at a megaft-commbench run directory (or its commbench.json)"
    try:
        doc = _load(path, os.path.getmtime(path))
    except (OSError, ValueError) as exc:
        return cluster, [], [f"cluster.measured={cluster.measured!r}: cannot read {path} ({exc}); {fix}"]
    if doc.get("schema") != SCHEMA:
        return cluster, [], [f"cluster.measured={cluster.measured!r}: {path} has schema {doc.get('schema')!r}, "
                             f"not {SCHEMA!r}; {fix}"]
    links = measured_links(doc)
    if not links:
        return cluster, [], [f"cluster.measured={cluster.measured!r}: {path} holds no correct all-reduce over "
                             f"intra_node or inter_node; fix: rerun megaft-commbench with all_reduce in "
                             f"commbench.collectives on 2 or more ranks per node (or nodes)"]
    changes, notes = {}, []
    for scope, (gbps_key, latency_key) in LINKS.items():
        got = links.get(scope)
        if got is None:
            notes.append(f"{scope}: not measured in {path}; {gbps_key} stays the datasheet's "
                         f"{getattr(cluster, gbps_key):g} GB/s")
            continue
        changes[gbps_key] = got["gbps"] / cluster.comm_fraction
        changes[latency_key] = got["latency_us"]
        notes.append(f"{scope}: {got['gbps']:.3g} GB/s bus bandwidth (all_reduce of {got['bytes']} bytes over "
                     f"{got['ranks']} ranks), {got['latency_us']:.3g} us per ring step, from {path}")
    return dataclasses.replace(cluster, **changes), notes, []
