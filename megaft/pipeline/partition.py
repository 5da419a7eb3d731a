"""Which layers each virtual pipeline stage holds, and the pipeline config checks.

Layers are split over pp*vpp virtual stages (Megatron interleaving: rank r holds
virtual stages r, r + pp, ...). By default the split is as even as possible with
the earlier stages taking the extra layer; `parallel.pp_layers` lists the layer
count of every virtual stage instead. The embedding lives on virtual stage 0, the
final norm, the head and the loss on the last one.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

from megaft.pipeline.schedules import SCHEDULES


def stage_layer_counts(n_layers: int, stages: int, pp_layers: Optional[Sequence[int]] = None) -> list[int]:
    """Layers per virtual stage (stage order); raises ValueError on an impossible split."""
    if pp_layers:
        counts = [int(c) for c in pp_layers]
        problems = check_split(n_layers, stages, counts)
        if problems:
            raise ValueError("; ".join(problems))
        return counts
    if n_layers < stages:
        raise ValueError(f"{n_layers} layers cannot fill {stages} pipeline stages (pp*vpp); each needs >= 1 layer")
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def stage_layers(n_layers: int, stages: int, pp_layers: Optional[Sequence[int]] = None) -> list[range]:
    """The global layer indices of every virtual stage."""
    return list(_stage_layers(n_layers, stages, tuple(pp_layers) if pp_layers else None))


@functools.lru_cache(maxsize=1024)  # the planner asks for the same few splits ~15,000 times
def _stage_layers(n_layers: int, stages: int, pp_layers: Optional[tuple]) -> tuple[range, ...]:
    out, start = [], 0
    for count in stage_layer_counts(n_layers, stages, pp_layers):
        out.append(range(start, start + count))
        start += count
    return tuple(out)


def check_split(n_layers: int, stages: int, counts: Sequence[int]) -> list[str]:
    problems = []
    if len(counts) != stages:
        problems.append(f"parallel.pp_layers has {len(counts)} entries but there are pp*vpp = {stages} "
                        f"virtual stages; fix: give one layer count per virtual stage")
    if any(c < 1 for c in counts):
        problems.append(f"parallel.pp_layers={list(counts)} has a stage without layers; fix: every entry >= 1")
    if sum(counts) != n_layers:
        problems.append(f"parallel.pp_layers={list(counts)} sums to {sum(counts)}, not model.n_layers={n_layers}; "
                        f"fix: make the counts add up to {n_layers}")
    return problems


def check_pipeline(pp: int, vpp: int, schedule: str, pp_layers: Optional[Sequence[int]], n_layers: int,
                   microbatches: int) -> list[str]:
    """Every problem of the pipeline settings against the model depth and micro-batch count."""
    problems = []
    if vpp < 1:
        return [f"parallel.vpp={vpp} must be >= 1"]
    if schedule not in SCHEDULES:
        return [f"parallel.schedule={schedule!r} is unknown; fix: one of {', '.join(SCHEDULES)}"]
    if vpp > 1 and schedule != "interleaved":
        problems.append(f"parallel.vpp={vpp} needs parallel.schedule=interleaved (got {schedule}); "
                        "fix: set parallel.schedule=interleaved or parallel.vpp=1")
    if pp == 1:
        if vpp > 1:
            problems.append(f"parallel.vpp={vpp} needs parallel.pp > 1; fix: parallel.vpp=1")
        return problems
    stages = pp * vpp
    if pp_layers:
        problems += check_split(n_layers, stages, list(pp_layers))
    elif n_layers < stages:
        problems.append(f"model.n_layers={n_layers} < pp*vpp = {pp}*{vpp}: every virtual stage needs a layer; "
                        "fix: lower parallel.pp or parallel.vpp")
    if schedule == "interleaved" and microbatches % pp:
        problems.append(f"the interleaved schedule needs the micro-batches per step (global_batch_size / "
                        f"(micro_batch_size * dp) = {microbatches}) to be a multiple of pp={pp}; fix: change "
                        "train.global_batch_size or train.micro_batch_size, or use parallel.schedule=1f1b")
    return problems
