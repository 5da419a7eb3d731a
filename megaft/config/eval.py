"""EvalConfig (`eval.*`): what `megaft-eval` runs with lm-eval-harness (its checks, and those of
`train.then_eval` done before a run is submitted, read task files: megaft.eval.checks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)  # lm_eval task (or group) names, e.g. [megaft_arith,megaft_copy]
    include: Optional[str] = None  # a folder of extra task YAMLs (searched with megaft's own, megaft/eval/tasks)
    batch_size: int = 8  # sequences per forward
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    # the weights' dtype in transformers: auto (a run's precision; an HF folder as saved) | float32 | bfloat16 | float16
    dtype: str = "auto"
    limit: Optional[int] = None  # evaluate only the first N documents of each task (smoke tests); null = all
    num_fewshot: Optional[int] = None  # few-shot examples per prompt; null = each task's own setting
    # a reward model (train.objective=reward's export): held-out preference pairs (JSONL, data.path's forms)
    # whose pairwise accuracy megaft-eval reports instead of lm_eval's tasks; null = run eval.tasks
    pairs: Optional[str] = None
    # The Slurm job of `train.then_eval` (hydra_plugins/megaft_slurm_launcher): its limit, and its GPUs
    timeout_min: int = 60  # wall-clock limit of the eval job (--time)
    gpus: int = -1  # GPUs of the eval job; -1 = one when the training preset has GPUs, else none
