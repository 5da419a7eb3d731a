"""commbench.json, commbench.csv and commbench.png in the run directory, and the printed table."""
from __future__ import annotations

import csv
import os

from megaft.commbench.verdict import human_bytes
from megaft.fileio import write_json_atomic

CSV_FIELDS = ["scope", "group", "collective", "bytes", "ranks", "groups", "time_s", "time_p20_s", "time_p80_s",
              "algbw_gbps", "busbw_gbps", "correct", "error", "sent_bytes", "recv_bytes", "model_time_s"]


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _scope_header(s: dict, measured: bool = False) -> str:
    if s["same_as"]:
        return (f"{s['name']}: the same groups as {s['same_as']} ({s['spans']}), measured there"
                + ("; its own rows below" if measured else ""))
    if not s["groups"]:
        return f"{s['name']}: none ({s['note']})"
    n = len(s["groups"])
    return f"{s['name']}: {n} group{'s' if n > 1 else ''} of {s['group_size']} ranks, {s['spans']}"


def format_pairs(pairs: dict) -> list[str]:
    if not pairs["matrix"]:
        return [f"node pairs: none ({pairs['note']})"]
    hosts = pairs["hosts"]
    gbps = {(m["src"], m["dst"]): m["gbps"] for m in pairs["matrix"]}
    width = max(8, *(len(h) for h in hosts)) + 2
    lines = [f"node pairs: point-to-point GB/s at {human_bytes(pairs['bytes'])}, row = sender, "
             f"median {_num(pairs['median_gbps'], '.3g')}",
             " " * width + "".join(h.rjust(width) for h in hosts)]
    for a in hosts:
        cells = ["-" if a == b else ("wrong" if (a, b) in gbps and gbps[(a, b)] is None else
                                      _num(gbps.get((a, b)), ".3g")) for b in hosts]
        lines.append(a.ljust(width) + "".join(c.rjust(width) for c in cells))
    lines += [f"  slow: {s['src']} -> {s['dst']} {s['gbps']:.3g} GB/s = {s['ratio']:.2f}x the median "
              f"(< {pairs['slow_fraction']:g})" for s in pairs["slow"]]
    return lines


def format_table(doc: dict) -> str:
    """The run as text: one block per scope (nccl-tests' columns), then the node-pair matrix."""
    hosts = doc["hosts"]
    g = doc["grid"]
    lines = [f"megaft-commbench: {doc['world_size']} ranks on {len(hosts)} host(s), {doc['backend']} on "
             f"{doc['device_name']}, {doc['dtype']}; grid tp={g['tp']} cp={g.get('cp', 1)} dp={g['dp']} pp={g['pp']}"
             + (f" ep={g['ep']}" if g.get("ep", 1) > 1 else "")]
    for s in doc["scopes"]:
        rows = [r for r in doc["results"] if r["scope"] == s["name"]]
        lines.append(_scope_header(s, bool(rows)))
        width = max([15] + [len(r["collective"]) + 2 for r in rows])
        if rows:
            lines.append(f"  {'collective':<{width}}{'size':>10}{'time us':>11}{'p20-p80 us':>17}{'algbw':>9}"
                         f"{'busbw GB/s':>12}")
        for r in rows:
            spread = f"{r['time_p20_s'] * 1e6:.0f}-{r['time_p80_s'] * 1e6:.0f}"
            tail = "" if r["correct"] else f"   WRONG: {r['error']}"
            lines.append(f"  {r['collective']:<{width}}{human_bytes(r['bytes']):>10}{r['time_s'] * 1e6:>11.1f}"
                         f"{spread:>17}{_num(r['algbw_gbps'], '.3f'):>9}{_num(r['busbw_gbps'], '.3f'):>12}{tail}")
        if s["name"] == "ep" and "splits" in doc.get("ep", {}):
            lines += format_ep(doc["ep"], rows)
    return "\n".join(lines + format_pairs(doc["pairs"]))


def format_ep(ep: dict, rows: list[dict]) -> list[str]:
    """The ep all-to-all's sizes, each routing's splits and heaviest rank, and the cost model's price."""
    lines = [f"  ep all-to-all: {ep['tokens']} tokens x top_k {ep['top_k']} rows of {ep['row_bytes']} B "
             f"(dim {ep['dim']} x {ep['elem_bytes']} B) per rank, {ep['n_experts']} experts over ep={ep['ep']}; "
             f"a2a_bytes {human_bytes(int(ep['a2a_bytes']))} per block and pass"]
    for r in rows:
        if "splits" not in r:
            continue
        ratio = "" if r.get("model_ratio") is None else f", measured / model {r['model_ratio']:.2f}x"
        lines.append(f"    {r['collective']}: rows [source][destination] {r['splits']}; most sent to others "
                     f"{human_bytes(r['sent_bytes'])}, received {human_bytes(r['recv_bytes'])}{ratio}")
    model = ep["model"]
    lines.append("  cost model: " + (f"{model['time_s'] * 1e6:.1f} us per all-to-all ({model['note']})"
                                     if model["time_s"] is not None else f"none ({model['note']})"))
    return lines


def write_csv(doc: dict, path: str) -> None:
    """One line per result row, then one per node pair (scope node_pair, group "src->dst")."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in doc["results"]:
            w.writerow(dict(r, group=" ".join(map(str, r["slowest_group"]))))
        for m in doc["pairs"]["matrix"]:
            w.writerow({"scope": "node_pair", "group": f"{m['src']}->{m['dst']}", "collective": "send_recv",
                        "bytes": doc["pairs"]["bytes"], "ranks": 2, "groups": 1, "time_s": m["time_s"],
                        "algbw_gbps": m["gbps"], "busbw_gbps": m["gbps"], "correct": m["correct"],
                        "error": m["error"]})
    os.replace(tmp, path)


def write_png(doc: dict, path: str) -> None:
    """Bus bandwidth against size, one panel per measured scope; the node-pair matrix as a heat map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scopes = [s["name"] for s in doc["scopes"] if any(r["scope"] == s["name"] for r in doc["results"])]
    pairs = doc["pairs"]
    panels = len(scopes) + (1 if pairs["matrix"] else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.5 * max(panels, 1), 4), squeeze=False)
    for ax, scope in zip(axes[0], scopes):
        rows = [r for r in doc["results"] if r["scope"] == scope and r["busbw_gbps"] is not None]
        for c in dict.fromkeys(r["collective"] for r in rows):
            pts = sorted((r["bytes"], r["busbw_gbps"]) for r in rows if r["collective"] == c)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
        ax.set(xscale="log", xlabel="size (bytes)", ylabel="bus bandwidth (GB/s)", title=scope)
        ax.legend(fontsize=7)
    if pairs["matrix"]:
        ax, hosts = axes[0][len(scopes)], pairs["hosts"]
        grid = [[float("nan")] * len(hosts) for _ in hosts]
        for m in pairs["matrix"]:
            grid[hosts.index(m["src"])][hosts.index(m["dst"])] = m["gbps"] if m["gbps"] is not None else 0.0
        im = ax.imshow(grid, cmap="viridis")
        ax.set(xticks=range(len(hosts)), yticks=range(len(hosts)), xlabel="receiver", ylabel="sender",
               title=f"node pairs, GB/s at {human_bytes(pairs['bytes'])}")
        ax.set_xticklabels(hosts, rotation=90, fontsize=7)
        ax.set_yticklabels(hosts, fontsize=7)
        fig.colorbar(im, ax=ax)
    if not panels:
        axes[0][0].text(0.5, 0.5, "nothing measured (one rank?)", ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(doc: dict, run_dir: str, *, plot: bool = True) -> list[str]:
    """Write the files into run_dir; returns their paths."""
    os.makedirs(run_dir, exist_ok=True)
    paths = [os.path.join(run_dir, f"commbench.{ext}") for ext in ("json", "csv", "png")]
    write_json_atomic(paths[0], doc)
    write_csv(doc, paths[1])
    if plot:
        write_png(doc, paths[2])
    return paths if plot else paths[:2]
