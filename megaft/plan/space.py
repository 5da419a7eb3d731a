"""The layouts `megaft-plan` considers, checked by megaft's own validation.

A layout is tp, cp, pp, vpp, dp, ep, the ZeRO stage, the micro-batch size, optimizer offload
and recompute, on all `cluster.nodes * cluster.gpus_per_node` ranks:

* tp: divisors of gpus_per_node (tp stays within a node), at most `plan.max_tp`; with
  tp > 1 sequence parallelism is on (same bytes as plain tp, less activation memory);
* pp: divisors of world / tp; layers split as megaft does by default (as even as
  possible, earlier stages take the extra layer, so pp need not divide the layers);
* vpp: 1, or 2, 4, ... up to `plan.max_vpp` with the interleaved schedule when pp > 1;
* cp: 1, 2, 4, ... up to `plan.max_cp`, dividing world / (tp·pp), while each rank keeps
  at least `plan.min_cp_tokens` tokens of a row (validation drops the ones data.seq_len
  does not allow);
* dp = world / (tp·cp·pp); zero: `plan.zero_stages` (with dp = 1 only the lowest: the
  stages are the same then); micro-batch: divisors of train.global_batch_size up to
  `plan.max_micro_batch_size`; offload: none, or also cpu (`plan.offload`);
* ep (mixtures of experts, model.n_experts > 0): the divisors of dp·cp that divide
  model.n_experts (each ep rank holds n_experts/ep of every MoE block's routed experts,
  tokens reach them by all-to-all); 1 alone for a dense model, whose layouts are unchanged;
* recompute: none, selective, full (model.recompute, all blocks).

Every layout goes through `check_settings` and `check_resolved` (the two halves of
megaft.config.validate around `resolve`, which the planner does once up front), with the
cluster's memory budget for the memory estimate. A rejected layout is counted under the
reason of its first problem (`REASONS`), with that problem kept as an example.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

from megaft.forks import deal, fork_map, undeal
from megaft.perf.counts import total_params
from megaft.perf.hardware import GIB, gpu_type_memory
from megaft.perf.memory import MemoryEstimate, check_memory, estimate_memory
from megaft.perf.time import StepCost, step_costs
from megaft.validation import check_layout, check_layout_settings, check_resolved, check_settings

# (substring of a validation problem, the reason it is counted under); first match wins.
REASONS = (
    ("estimated memory per GPU", "memory estimate over the budget"),
    ("does not divide model.", "tp does not divide the heads, kv heads or MLP width"),
    ("global_batch_size", "micro-batch x dp does not divide the global batch"),
    ("interleaved schedule needs", "interleaved: micro-batches per step not a multiple of pp"),
    ("every virtual stage needs a layer", "more pipeline stages (pp x vpp) than layers"),
    ("tied copies", "zero>=2 with pp>1 and tied embeddings"),
    ("parallel.zero=3 does not support", "zero=3 with an unsupported feature"),
    ("lora with parallel.zero=3", "zero=3 with LoRA"),
    ("than the model's", "LoRA on k/v with tp wider than the kv heads"),
    ("cannot evaluate the generated task", "ep>1 with the generated task (no data.path)"),
)
NOOP_ZERO = "zero stage > 0 with dp=1 (the same as the lowest stage)"


RECOMPUTE = ("none", "selective", "full")  # model.recompute modes, cheapest in compute first


@dataclass(frozen=True)
class Layout:
    """One point of the search space; `overrides()` are its megaft-train overrides."""

    tp: int
    pp: int
    dp: int
    vpp: int = 1
    zero: int = 0
    micro_batch_size: int = 1
    offload: str = "none"
    cp: int = 1  # parallel.cp: every sequence split over cp ranks (ring attention)
    recompute: str = "none"  # model.recompute: none | selective | full
    ep: int = 1  # parallel.ep: the routed experts split over ep of the dp×cp replicas (1 for dense models)

    @property
    def schedule(self) -> str:
        return "interleaved" if self.vpp > 1 else "1f1b"

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def overrides(self) -> list[str]:
        return [f"parallel.tp={self.tp}", f"parallel.cp={self.cp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
                f"parallel.vpp={self.vpp}", f"parallel.schedule={self.schedule}",
                f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
                f"parallel.zero={self.zero}", f"parallel.offload={self.offload}",
                f"train.micro_batch_size={self.micro_batch_size}", f"model.recompute={self.recompute}",
                *([f"parallel.ep={self.ep}"] if self.ep > 1 else [])]  # ep=1: megaft-train's default

    def short(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"tp={self.tp} cp={self.cp} pp={self.pp} vpp={self.vpp} dp={self.dp}{ep} zero={self.zero} "
                f"mbs={self.micro_batch_size} offload={self.offload} recompute={self.recompute}")


@dataclass
class Candidate:
    """A layout that passed validation: its config, memory estimate and predicted step."""

    layout: Layout
    cfg: object  # megaft.config.Config with the layout applied
    memory: MemoryEstimate
    cost: StepCost


@dataclass
class SearchResult:
    ranked: list  # Candidates, fastest first
    rejected: Counter = field(default_factory=Counter)  # reason -> layouts
    examples: dict = field(default_factory=dict)  # reason -> the first problem counted under it
    reasons: dict = field(default_factory=dict)  # Layout -> (reason, problem) of every rejected layout
    considered: int = 0
    budget: tuple = (0, "")  # (bytes per GPU, its source)

    def rank_of(self, layout: Layout) -> Optional[int]:
        """1-based rank of `layout` among the valid ones, None when it was rejected."""
        return next((i + 1 for i, c in enumerate(self.ranked) if c.layout == layout), None)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_target(cluster) -> tuple[int, str]:
    """(bytes per GPU, source) of the cluster: its gpu_type's budget (megaft.perf.hardware's table,
    as Slurm sweeps use), else hbm_gb."""
    if cluster.gpu_type:
        gib, _ = gpu_type_memory(cluster.gpu_type)
        if gib is not None:
            return int(gib * GIB), f"cluster={cluster.name}: {gib:g} GiB"
    return int(cluster.hbm_gb * 1e9), f"cluster={cluster.name}: {cluster.hbm_gb:g} GB"


def expert_degrees(cfg, replicas: int) -> list[int]:
    """The ep values tried with `replicas` = dp·cp ranks: its divisors that divide
    model.n_experts; [1] for a dense model."""
    experts = cfg.model.n_experts
    return [e for e in divisors(replicas) if experts % e == 0] if experts else [1]


def layouts(cfg, cluster, plan) -> Iterator[Layout]:
    """Every layout of the search space (module docstring), including invalid ones."""
    world, gpn = cluster.world_size, cluster.gpus_per_node
    max_tp = plan.max_tp or gpn
    vpps = [1] + [v for v in (2 ** i for i in range(1, 8)) if v <= plan.max_vpp]
    cps = [1] + [c for c in (2 ** i for i in range(1, 8))
                 if c <= plan.max_cp and cfg.data.seq_len // c >= plan.min_cp_tokens]
    mbs = [d for d in divisors(cfg.train.global_batch_size) if d <= plan.max_micro_batch_size]
    offloads = ["none", "cpu"] if plan.offload else ["none"]
    for tp in [d for d in divisors(gpn) if d <= max_tp and world % d == 0]:
        for pp, cp in ((p, c) for p in divisors(world // tp) for c in cps if world // (tp * p) % c == 0):
            dp = world // (tp * pp * cp)
            for ep in expert_degrees(cfg, dp * cp):
                for vpp in vpps if pp > 1 else [1]:
                    for zero in sorted(set(plan.zero_stages)):
                        for mb in mbs:
                            for offload in offloads:
                                for recompute in RECOMPUTE:
                                    yield Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, zero=zero, micro_batch_size=mb,
                                                 offload=offload, cp=cp, recompute=recompute, ep=ep)


def apply_layout(cfg, layout: Layout):
    """A copy of `cfg` (megaft.config.Config) running `layout`; `cfg` is not changed."""
    par = _replace(cfg.parallel, tp=layout.tp, pp=layout.pp, dp=layout.dp, vpp=layout.vpp, cp=layout.cp,
                   ep=layout.ep, schedule=layout.schedule if layout.pp > 1 else cfg.parallel.schedule,
                   sequence_parallel=layout.sequence_parallel, zero=layout.zero, offload=layout.offload,
                   pp_layers=None)
    train = _replace(cfg.train, micro_batch_size=layout.micro_batch_size)
    model = _replace(cfg.model, recompute=layout.recompute, recompute_layers=None)
    return _replace(cfg, parallel=par, train=train, model=model)


def _replace(obj, **changes):
    """dataclasses.replace for plain config dataclasses (no __post_init__ to rerun), without
    the constructor call: the planner copies four per layout, thousands of times."""
    fields = obj.__dataclass_fields__
    unknown = [k for k in changes if k not in fields]
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {unknown[0]!r}")
    new = object.__new__(type(obj))  # a shallow copy, as copy.copy makes it, at a third of the cost
    new.__dict__.update(obj.__dict__, **changes)
    return new


def layout_problems(cfg, world: int, budget: tuple[int, str]) -> list[str]:
    """megaft.config.validate's checks of a resolved config (it has no files left to resolve)."""
    return check_settings(cfg, world) + check_resolved(cfg, world, gpu_budget=budget)


def checked(cfg, world: int, budget: tuple[int, str], tower=None) -> tuple[list[str], Optional[MemoryEstimate]]:
    """layout_problems of a layout of the planning config, whose layout-free settings
    megaft.plan.shape.planning_config checked once, and for a layout without other
    problems its memory estimate (computed once: the memory check and the ranking read it;
    `tower`: a vision-language model's TowerLoad, megaft.plan.vision)."""
    problems = check_layout_settings(cfg, world) + check_layout(cfg, world)
    if problems:
        return problems, None
    est = estimate_memory(cfg, world) if tower is None else tower.memory(cfg, world)
    return check_memory(cfg, world, budget, estimate=est), est


def reason_of(problem: str) -> str:
    for needle, reason in REASONS:
        if needle in problem:
            return reason
    return problem.split(" ", 1)[0].split("=", 1)[0]  # the config key the problem names


def search(cfg, cluster, plan, workers: int = 1, tower=None) -> SearchResult:
    """Every layout of the space checked and costed; valid ones ranked by predicted step
    time (ties: lower ZeRO stage, no offload, fewer stages, smaller tp, no cp, smaller ep, less memory).
    `workers` > 1: checked and costed over that many processes (megaft.forks), with the
    same result: every layout's check and cost depends on that layout alone. `tower`: a
    vision-language model's tower (megaft.plan.vision.TowerLoad), counted in every layout."""
    world, budget = cluster.world_size, memory_target(cluster)
    result = SearchResult(ranked=[], budget=budget)
    lowest_zero = min(plan.zero_stages)
    todo = []  # (layout, its config or None when it is a no-op ZeRO stage)
    for layout in layouts(cfg, cluster, plan):
        result.considered += 1
        noop = layout.dp * layout.cp == 1 and layout.zero != lowest_zero  # ZeRO shards over dp×cp
        todo.append((layout, None if noop else apply_layout(cfg, layout)))
    cands = [cand for _, cand in todo if cand is not None]
    found = iter(undeal(fork_map(lambda hand: [checked(c, world, budget, tower) for c in hand],
                                 deal(cands, workers))))
    valid = []
    for layout, cand in todo:  # in the space's order: the first example of each reason is the same
        if cand is None:
            problems = [f"parallel.zero={layout.zero} with dp=1 does what zero={lowest_zero} does"]
            reason = NOOP_ZERO
        else:
            problems, memory = next(found)
            reason = reason_of(problems[0]) if problems else ""
        if problems:
            result.rejected[reason] += 1
            result.examples.setdefault(reason, problems[0])
            result.reasons[layout] = (reason, problems[0])
            continue
        valid.append((layout, cand, memory))
    # costed together: layouts that share a pipeline schedule share one replay
    costs = step_costs([cand for _, cand, _ in valid], cluster, world, workers)
    if tower is not None:
        costs = [tower.cost(cost, cand, cluster, world) for (_, cand, _), cost in zip(valid, costs)]
    result.ranked = [Candidate(layout, cand, memory, cost) for (layout, cand, memory), cost in zip(valid, costs)]
    result.ranked.sort(key=lambda c: (round(c.cost.step_s, 6), c.layout.zero, c.layout.offload != "none",
                                      c.layout.pp * c.layout.vpp, c.layout.tp, c.layout.cp, c.layout.ep,
                                      c.memory.total))
    return result


def rule_of_thumb(cfg, cluster) -> Layout:
    """The usual advice: under 10B parameters data parallel; under 100B tensor parallel
    within a node plus data parallel; above, tensor + pipeline + data parallel with the
    fewest stages whose weights, grads and Adam state (16 bytes/param) take at most half
    of a GPU. ZeRO-1 (Megatron's distributed optimizer), micro-batch 1, no offload; ep=1
    (a dense model's advice; megaft.plan.report.explain_experts explains a mixture's ep)."""
    world, gpn = cluster.world_size, cluster.gpus_per_node
    params = total_params(cfg.model)
    tp = 1 if params < 10e9 else min(gpn, world)
    pp = 1
    if params >= 100e9:
        half = memory_target(cluster)[0] / 2
        pps = [p for p in divisors(world // tp) if p > 1]
        pp = next((p for p in pps if 16 * params / (tp * p) <= half), pps[-1] if pps else 1)
    dp = world // (tp * pp)
    return Layout(tp=tp, pp=pp, dp=dp, zero=1 if dp > 1 else 0)
