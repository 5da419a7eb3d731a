"""What `megaft-plan` prints and writes: the table of the top layouts, the rejection
counts, the rule-of-thumb explanation, for a mixture of experts why the best layout's
expert-parallel degree won (explain_experts), and plan.json."""
from __future__ import annotations

import dataclasses
import shlex
from collections import Counter

from megaft.perf.counts import total_params
from megaft.perf.hardware import GIB
from megaft.perf.memory import estimate_memory
from megaft.perf.time import TERMS, step_cost
from megaft.plan.space import Layout, SearchResult, apply_layout, expert_degrees, layout_problems, reason_of

COLUMNS = ("#", "tp", "pp", "vpp", "cp", "dp", "zero", "mbs", "recompute", "offload", "mem GiB", "step s",
           "tok/s/GPU", "MFU", "bottleneck")
EP_COLUMNS = COLUMNS[:6] + ("ep",) + COLUMNS[6:]  # a mixture of experts' table: ep after dp


def columns(moe: bool) -> tuple:
    """The table's header: with an ep column for a mixture of experts (dense tables as before)."""
    return EP_COLUMNS if moe else COLUMNS


def layout_row(rank: int, cand, moe: bool = False) -> list[str]:
    lay, cost = cand.layout, cand.cost
    return [str(rank), str(lay.tp), str(lay.pp), str(lay.vpp), str(lay.cp), str(lay.dp),
            *([str(lay.ep)] if moe else []), str(lay.zero),
            str(lay.micro_batch_size), lay.recompute, lay.offload, f"{cand.memory.total / GIB:.1f}",
            f"{cost.step_s:.3g}", f"{cost.tokens_per_s_per_gpu:.4g}", f"{100 * cost.mfu:.1f}%", cost.bottleneck]


def format_table(rows: list[list[str]], header=COLUMNS) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(f"{h:>{w}}" for h, w in zip(header, widths))]
    lines += ["  ".join(f"{c:>{w}}" for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def format_rejections(result: SearchResult) -> str:
    valid = len(result.ranked)
    lines = [f"{result.considered} layouts considered, {valid} valid, "
             f"{result.considered - valid} rejected:"]
    for reason, count in result.rejected.most_common():
        lines.append(f"  {count:6d}  {reason}  (e.g. {result.examples[reason]})")
    return "\n".join(lines)


def explain_rule(result: SearchResult, rule: Layout, cfg, cluster) -> dict:
    """Why the rule-of-thumb layout lost: its validation problem, or its terms against the best."""
    out = {"layout": dataclasses.asdict(rule), "overrides": rule.overrides()}
    rank = result.rank_of(rule)
    if rank is None:
        if rule in result.reasons:
            reason, problem = result.reasons[rule]
        else:  # outside the searched space (plan.* limits): check it the same way
            problems = layout_problems(apply_layout(cfg, rule), cluster.world_size, result.budget)
            reason, problem = (reason_of(problems[0]), problems[0]) if problems else ("", "")
        if problem:
            return {**out, "status": "rejected", "reason": reason, "problem": problem}
    cand = apply_layout(cfg, rule)
    cost, best = step_cost(cand, cluster, cluster.world_size), result.ranked[0].cost if result.ranked else None
    out.update(status="valid", rank=rank, step_s=cost.step_s, mfu=cost.mfu,
               memory_gib=estimate_memory(cand, cluster.world_size).total / GIB, terms=cost.terms)
    if best is not None:
        out["slower_by_s"] = cost.step_s - best.step_s
        out["term_differences_s"] = {t: cost.terms[t] - best.terms[t] for t in TERMS
                                     if abs(cost.terms[t] - best.terms[t]) > 1e-4 * best.step_s}
    return out


def format_explanation(info: dict) -> str:
    head = "rule of thumb: " + Layout(**info["layout"]).short()
    if info["status"] == "rejected":
        return f"{head}\n  rejected ({info['reason']}): {info['problem']}"
    lines = [f"{head}\n  valid, rank {info['rank']}, step {info['step_s']:.3g} s, MFU {100 * info['mfu']:.1f}%, "
             f"{info['memory_gib']:.1f} GiB"]
    if "slower_by_s" in info and info["slower_by_s"] > 0:
        diffs = sorted(info["term_differences_s"].items(), key=lambda kv: -kv[1])
        lines.append(f"  {info['slower_by_s']:.3g} s slower than the best: " +
                     ", ".join(f"{t} {d:+.3g} s" for t, d in diffs))
    return "\n".join(lines)


def explain_experts(result: SearchResult, cfg, cluster) -> dict | None:
    """Why the best layout of a mixture of experts has its ep (None for a dense model or
    when nothing fits): the best layout's ep_comm and memory; the same layout at every other
    ep its dp×cp allows (what ep saves in memory per GPU, what its all-to-alls cost); and
    the best layout at each ep searched, or why none at that ep fits (rejections by reason)."""
    if not cfg.model.n_experts or not result.ranked:
        return None
    best, world = result.ranked[0], cluster.world_size
    rank = {c.layout: i for i, c in enumerate(result.ranked)}

    def entry(layout: Layout) -> dict:
        out = {"ep": layout.ep, "layout": layout.short()}
        if layout in rank:
            c = result.ranked[rank[layout]]
            return {**out, "status": "valid", "rank": rank[layout] + 1, "step_s": c.cost.step_s,
                    "memory_gib": c.memory.total / GIB, "ep_comm_s": c.cost.terms["ep_comm"],
                    "slower_by_s": c.cost.step_s - best.cost.step_s,
                    "term_differences_s": {t: c.cost.terms[t] - best.cost.terms[t] for t in TERMS
                                           if abs(c.cost.terms[t] - best.cost.terms[t]) > 1e-4 * best.cost.step_s}}
        if layout in result.reasons:
            reason, problem = result.reasons[layout]
        else:  # not searched (every ep of a searched layout is): checked the same way
            problems = layout_problems(apply_layout(cfg, layout), world, result.budget) or ["not searched"]
            reason, problem = reason_of(problems[0]), problems[0]
        out.update(status="rejected", reason=reason, problem=problem)
        if reason == "memory estimate over the budget":
            out["memory_gib"] = estimate_memory(apply_layout(cfg, layout), world).total / GIB
        return out

    lay = best.layout
    same = [entry(dataclasses.replace(lay, ep=ep)) for ep in expert_degrees(cfg, lay.dp * lay.cp) if ep != lay.ep]
    per_ep = []
    searched = sorted({c.layout.ep for c in result.ranked} | {layout.ep for layout in result.reasons})
    for ep in searched:
        top = next((c for c in result.ranked if c.layout.ep == ep), None)
        if top is not None:
            per_ep.append(entry(top.layout))
        else:
            reasons = Counter(reason for layout, (reason, _) in result.reasons.items() if layout.ep == ep)
            per_ep.append({"ep": ep, "status": "none valid", "rejected": dict(reasons.most_common())})
    return {"ep": lay.ep, "layout": lay.short(), "step_s": best.cost.step_s, "ep_comm_s": best.cost.terms["ep_comm"],
            "memory_gib": best.memory.total / GIB, "budget_gib": result.budget[0] / GIB,
            "same_layout": same, "best_per_ep": per_ep}


def _entry_line(e: dict, chosen: dict) -> str:
    if e["status"] == "none valid":
        return "none fits: " + ", ".join(f"{n} {r}" for r, n in e["rejected"].items())
    if e["status"] == "rejected":
        mem = (f"{e['memory_gib']:.1f} GiB, {e['memory_gib'] - chosen['memory_gib']:+.1f} GiB against ep="
               f"{chosen['ep']}: " if "memory_gib" in e else "")
        return f"rejected ({mem}{e['reason']})"
    diffs = sorted(e["term_differences_s"].items(), key=lambda kv: -abs(kv[1]))
    terms = ", ".join(f"{t} {d:+.3g} s" for t, d in diffs)
    return (f"rank {e['rank']}, {e['step_s']:.3g} s ({e['slower_by_s']:+.3g} s" + (f": {terms}" if terms else "")
            + f"), {e['memory_gib']:.1f} GiB ({e['memory_gib'] - chosen['memory_gib']:+.1f} GiB)")


def format_experts(info: dict) -> str:
    """explain_experts as text: the chosen ep, then the same layout and the best one at each other ep."""
    lines = [f"expert parallelism: ep={info['ep']} won ({info['layout']}): ep_comm {info['ep_comm_s']:.3g} s of "
             f"its {info['step_s']:.3g} s step, {info['memory_gib']:.1f} of {info['budget_gib']:.1f} GiB/GPU"]
    lines += [f"  same layout at ep={e['ep']}: {_entry_line(e, info)}" for e in info["same_layout"]]
    same = {e["layout"] for e in info["same_layout"]}
    for e in info["best_per_ep"]:
        if e["ep"] == info["ep"]:
            continue
        if e.get("layout") in same:
            lines.append(f"  best at ep={e['ep']}: the same layout (above)")
        else:
            where = f"{e['layout']}: " if "layout" in e else ""
            lines.append(f"  best at ep={e['ep']}: {where}{_entry_line(e, info)}")
    return "\n".join(lines)


def plan_json(result: SearchResult, cfg, cluster, *, user_overrides: list[str], top_k: int,
              explanation: dict | None, experts: dict | None = None) -> dict:
    m = cfg.model
    layouts = []
    for i, cand in enumerate(result.ranked[:top_k]):
        overrides = user_overrides + cand.layout.overrides()
        layouts.append({
            "rank": i + 1, **dataclasses.asdict(cand.layout), "schedule": cand.layout.schedule,
            "sequence_parallel": cand.layout.sequence_parallel, "overrides": overrides,
            "command": shlex.join(["megaft-train"] + overrides),
            "memory_gib": cand.memory.total / GIB,
            "memory_parts_gib": {k: getattr(cand.memory, k) / GIB
                                 for k in ("params", "grads", "optimizer", "activations", "buffers", "margin")},
            "step_s": cand.cost.step_s, "tokens_per_s_per_gpu": cand.cost.tokens_per_s_per_gpu,
            "mfu": cand.cost.mfu, "bottleneck": cand.cost.bottleneck, "terms_s": cand.cost.terms})
    return {
        "cluster": dataclasses.asdict(cluster), "world_size": cluster.world_size,
        "memory_budget_gib": result.budget[0] / GIB, "memory_budget_source": result.budget[1],
        "model": {"name": m.name, "params": total_params(m), "n_layers": m.n_layers, "dim": m.dim,
                  "n_heads": m.n_heads, "n_kv_heads": m.kv_heads, "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size,
                  **({"n_experts": m.n_experts, "top_k": m.top_k, "expert_ffn_dim": m.expert_ffn}
                     if m.n_experts else {})},
        "seq_len": cfg.data.seq_len, "global_batch_size": cfg.train.global_batch_size,
        "precision": str(cfg.precision), "considered": result.considered, "valid": len(result.ranked),
        "rejected": dict(result.rejected.most_common()), "rejected_examples": result.examples,
        "layouts": layouts, "rule_of_thumb": explanation,
        **({"expert_parallelism": experts} if experts is not None else {}),
    }
