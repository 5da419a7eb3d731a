"""The commbench.json document: every rank's timings combined into rows, in a stable schema.

Schema `megaft.commbench/1` (the planner's `cluster.measured=<run dir>` reads it, megaft.plan.measured):

- `world_size`, `backend`, `device`, `device_name`, `dtype` ("float32"), `torch`, `created`;
- `hosts`: {host: [ranks]}; `grid`: {"tp", "cp", "dp", "pp", "ep"};
- `config`: the commbench.* values, with `max_bytes` and `pair_bytes` resolved for the device;
- `scopes`: [{name, groups, group_size, spans, same_as, note}] (megaft.commbench.groups);
- `results`: one row per measured scope, collective and size: `scope`, `collective`,
  `bytes` (nccl-tests' size column), `ranks` (group size), `groups` (groups that ran at
  once), `time_s` (median), `time_p20_s`, `time_p80_s`, `algbw_gbps`, `busbw_gbps` (GB/s,
  nccl-tests' definitions, from the median time), `slowest_group` (the row's numbers are
  that group's: the slowest bounds a training step), `correct`, `error` (bandwidths are
  null when a result was wrong);
- the expert-parallel all-to-alls (scope `ep`, collectives `ep_all_to_all` and
  `ep_all_to_all_routed`, megaft.commbench.ep), one row each at the model's size, add
  `splits` ([source][destination] rows of the group), `sent_bytes` and `recv_bytes` (the
  most any rank of the slowest group sent to and received from the others), `a2a_bytes`
  (megaft.perf.counts.a2a_bytes), `model_time_s` (the cost model's price of one, null
  without a cluster preset) and `model_ratio` (time_s / model_time_s);
- `ep`: the ep all-to-all's sizes (EpPlan.describe: tokens, top_k, dim, elem_bytes,
  row_bytes, send_bytes, a2a_bytes, the routing's seed and skew, both splits) and `model`:
  {time_s, note}; or {note} when nothing was measured;
- `pairs`: {`bytes`, `hosts`, `matrix`: [{src, dst, gbps, time_s, correct, error}],
  `median_gbps`, `slow_fraction`, `slow`: [{src, dst, gbps, ratio}], `note`}.

A group's time of one iteration is the mean over its ranks (nccl-tests' default `-a 1`);
median and p20/p80 are over the timed iterations.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Optional

from megaft.commbench.busbw import GB, algbw_gbps, busbw_gbps
from megaft.commbench.pairs import slow_pairs
from megaft.config.commbench import Collective, EpCollective

SCHEMA = "megaft.commbench/1"


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _group_row(collective: str, nbytes: int, members: list[int], per_rank: list[dict]) -> dict:
    errors = [f"rank {r['rank']}: {r['error']}" for r in per_rank if r["error"]]
    iters = [statistics.fmean(ts) for ts in zip(*(r["times"] for r in per_rank))]
    median = statistics.median(iters)
    row = {"bytes": nbytes, "ranks": len(members), "time_s": median, "time_p20_s": percentile(iters, 20),
           "time_p80_s": percentile(iters, 80), "slowest_group": members, "correct": not errors,
           "error": "; ".join(errors) or None, "algbw_gbps": None, "busbw_gbps": None}
    if not errors:  # a wrong result is a failure, not a number
        row["algbw_gbps"] = algbw_gbps(nbytes, median)
        row["busbw_gbps"] = busbw_gbps(collective, nbytes, median, len(members))
    if "splits" in per_rank[0]:  # an ep all-to-all: the group's routing and its heaviest senders and receivers
        row.update(splits=per_rank[0]["splits"], sent_bytes=max(r["sent_bytes"] for r in per_rank),
                   recv_bytes=max(r["recv_bytes"] for r in per_rank))
    return row


def collective_rows(records: list[dict], scopes: list[dict]) -> list[dict]:
    """Rows of every (scope, collective, size) from all ranks' records; the slowest group per row."""
    groups_of = {s["name"]: s["groups"] for s in scopes}
    by_key: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_key[(r["scope"], r["collective"], r["size"])][r["group"]].append(r)
    rows = []
    for (scope, collective, size), groups in by_key.items():
        per_group = []
        for g, per_rank in groups.items():
            per_rank.sort(key=lambda r: r["rank"])
            per_group.append(_group_row(collective, per_rank[0]["bytes"], groups_of[scope][g], per_rank))
        wrong = [g for g in per_group if not g["correct"]]
        worst = wrong[0] if wrong else min(per_group, key=lambda g: g["busbw_gbps"])
        if wrong:
            worst = dict(worst, error="; ".join(g["error"] for g in wrong))
        rows.append({"scope": scope, "collective": collective, "size": size, "groups": len(per_group), **worst})
    order, ops = {s["name"]: i for i, s in enumerate(scopes)}, list(Collective) + list(EpCollective)
    rows.sort(key=lambda r: (order[r["scope"]], ops.index(r["collective"]), r["size"]))
    return rows


def pair_table(records: list[dict], hosts: list[str], nbytes: int, fraction: float) -> dict:
    """The node-pair matrix from the senders' times and the receivers' checks."""
    unique = list(dict.fromkeys(hosts))
    if len(unique) < 2:
        return {"bytes": nbytes, "hosts": unique, "matrix": [], "median_gbps": None, "slow_fraction": fraction,
                "slow": [], "note": f"one host ({unique[0]}): no node pair to measure"}
    times: dict[tuple, list[float]] = {}
    errors: dict[tuple, Optional[str]] = {}
    sizes: dict[tuple, int] = {}
    for r in records:
        key = (r["src"], r["dst"])
        sizes[key] = r["bytes"]
        if r["times"]:
            times[key] = r["times"]
        if r["error"]:
            errors[key] = r["error"]
    matrix = []
    for key, ts in times.items():
        median = statistics.median(ts)
        err = errors.get(key)
        matrix.append({"src": key[0], "dst": key[1], "time_s": median, "correct": err is None, "error": err,
                       "gbps": None if err else sizes[key] / median / GB})
    median, slow = slow_pairs({(m["src"], m["dst"]): m["gbps"] for m in matrix if m["gbps"] is not None}, fraction)
    return {"bytes": nbytes, "hosts": unique, "matrix": matrix, "median_gbps": median, "slow_fraction": fraction,
            "slow": slow, "note": ""}
