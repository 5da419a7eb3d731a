"""What `megaft-plan` prints and writes: the table of the top layouts, the rejection
counts, the rule-of-thumb explanation, and plan.json."""
from __future__ import annotations

import dataclasses
import shlex

from megaft.perf.counts import total_params
from megaft.perf.hardware import GIB
from megaft.perf.memory import estimate_memory
from megaft.perf.time import TERMS, step_cost
from megaft.plan.space import Layout, SearchResult, apply_layout, layout_problems, reason_of

COLUMNS = ("#", "tp", "pp", "vpp", "cp", "dp", "zero", "mbs", "recompute", "offload", "mem GiB", "step s",
           "tok/s/GPU", "MFU", "bottleneck")


def layout_row(rank: int, cand) -> list[str]:
    lay, cost = cand.layout, cand.cost
    return [str(rank), str(lay.tp), str(lay.pp), str(lay.vpp), str(lay.cp), str(lay.dp), str(lay.zero),
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


def plan_json(result: SearchResult, cfg, cluster, *, user_overrides: list[str], top_k: int,
              explanation: dict | None) -> dict:
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
                  "n_heads": m.n_heads, "n_kv_heads": m.kv_heads, "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size},
        "seq_len": cfg.data.seq_len, "global_batch_size": cfg.train.global_batch_size,
        "precision": str(cfg.precision), "considered": result.considered, "valid": len(result.ranked),
        "rejected": dict(result.rejected.most_common()), "rejected_examples": result.examples,
        "layouts": layouts, "rule_of_thumb": explanation,
    }
