"""What fails a run: a wrong result always; in check mode (job prologues) also a slow node
pair or a collective whose bus bandwidth at its largest size is below the floor. The ep
all-to-alls, measured at the model's size rather than swept, stand next to the cost model's
price (megaft.commbench.ep) and are held to no floor."""
from __future__ import annotations

from megaft.commbench.pairs import slow_pairs
from megaft.config.commbench import CommbenchConfig, EpCollective


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def wrong_results(doc: dict) -> list[str]:
    """Every collective or node pair whose result differed from the exact expected one."""
    out = [f"{r['collective']} over {r['scope']} at {human_bytes(r['bytes'])} returned a wrong result: {r['error']}"
           for r in doc["results"] if not r["correct"]]
    out += [f"send {m['src']} -> {m['dst']} delivered a wrong payload: {m['error']}"
            for m in doc["pairs"]["matrix"] if not m["correct"]]
    return out


def slow_links(doc: dict, fraction: float) -> list[str]:
    """Node pairs below fraction x the median pair bandwidth, named with hosts and ratio."""
    matrix = doc["pairs"]["matrix"]
    median, slow = slow_pairs({(m["src"], m["dst"]): m["gbps"] for m in matrix if m["gbps"] is not None}, fraction)
    return [f"slow link {s['src']} -> {s['dst']}: {s['gbps']:.3g} GB/s, {s['ratio']:.2f}x the median pair "
            f"bandwidth {median:.3g} GB/s (< commbench.slow_fraction={fraction:g})" for s in slow]


def below_floor(doc: dict, floor: float) -> list[str]:
    """(scope, collective) whose bus bandwidth at the largest measured size is below `floor` GB/s
    (the swept collectives: an ep all-to-all's size is the model's, often latency-bound)."""
    if floor <= 0:
        return []
    largest: dict[tuple, dict] = {}
    for r in doc["results"]:
        key = (r["scope"], r["collective"])
        swept = r["collective"] not in set(EpCollective)
        if swept and r["correct"] and (key not in largest or r["bytes"] > largest[key]["bytes"]):
            largest[key] = r
    spans = {s["name"]: s["spans"] for s in doc["scopes"]}
    return [f"{r['collective']} over {r['scope']} ({r['ranks']} ranks {spans.get(r['scope'], '')}): bus bandwidth "
            f"{r['busbw_gbps']:.3g} GB/s at {human_bytes(r['bytes'])} < commbench.min_busbw_gbps={floor:g}"
            for r in largest.values() if r["busbw_gbps"] < floor]


def verdict(doc: dict, cfg: CommbenchConfig) -> tuple[int, list[str]]:
    """(exit status, problems): 1 on any wrong result; with cfg.check also on slow links and
    collectives below the floor; 0 otherwise."""
    problems = wrong_results(doc)
    if cfg.check:
        problems += slow_links(doc, cfg.slow_fraction) + below_floor(doc, cfg.min_busbw_gbps)
    return (1 if problems else 0), problems
