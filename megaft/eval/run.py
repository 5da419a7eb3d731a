"""Running lm-eval-harness on a Target and writing eval/results.json.

lm_eval's own Python API does the work (`simple_evaluate` with its "hf" model on the
folder, megaft's task folder and eval.include added to its TaskManager), so the numbers
are the ones `lm_eval --model hf --model_args pretrained=DIR --include_path ...` prints for
the same folder. The network is off (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE): tasks read
local data files only.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from megaft.config.eval import EvalConfig
from megaft.eval.checks import include_paths, local_task_names
from megaft.eval.model_dir import EvalError, Target, ensure_tokenizer_config
from megaft.fileio import write_json_atomic

RESULTS_FILE = "results.json"
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def import_lm_eval():
    """The lm_eval module, or EvalError saying how to install it."""
    try:
        import lm_eval
    except ImportError as exc:
        raise EvalError(f"lm-eval-harness is not installed ({exc}); fix: pip install lm_eval==0.4.13 "
                        "(requirements.txt lists it)") from None
    return lm_eval


def task_manager(cfg: EvalConfig):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_paths(cfg))


def check_tasks(manager, cfg: EvalConfig) -> None:
    """EvalError naming the unknown tasks and the local ones that exist."""
    unknown = [t for t in cfg.tasks if t not in manager.all_tasks]
    if unknown:
        local = sorted(local_task_names(include_paths(cfg)))
        raise EvalError(f"unknown task(s) {', '.join(unknown)}; available from megaft and eval.include: "
                        f"{', '.join(local) or '-'} (and lm_eval's built-in tasks: `lm_eval ls tasks`, which need "
                        "their data sets in the local cache); fix: a task's `task:` name, or eval.include=DIR "
                        "with its YAML")


def device_of(cfg: EvalConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # megaft precision -> transformers


def eval_dtype(target: Target, cfg: EvalConfig) -> str:
    """eval.dtype, where auto on a run is the run's precision (its compute dtype; megaft's kernels do
    not apply: lm_eval runs the model in transformers)."""
    if cfg.dtype != "auto" or target.run_dir is None:
        return cfg.dtype
    from megaft.training.run_config import read_run_config

    run = read_run_config(target.run_dir)
    return TORCH_DTYPES[str(run.config.precision)] if run is not None else cfg.dtype


def lm_eval_arguments(target: Target, cfg: EvalConfig) -> dict[str, Any]:
    """simple_evaluate's arguments (besides the task manager): also what results.json records."""
    return dict(model="hf", model_args={"pretrained": target.hf_dir, "dtype": eval_dtype(target, cfg)},
                tasks=list(cfg.tasks),
                num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size, device=device_of(cfg), limit=cfg.limit,
                log_samples=False)


def evaluate(target: Target, cfg: EvalConfig) -> dict[str, Any]:
    """Run the tasks on target.hf_dir and write target.out_dir/results.json: lm_eval's result
    dict (results, configs, versions, n-shot, ...) plus a `megaft` record of what ran. With
    eval.pairs: a reward model's pairwise accuracy instead (megaft.eval.pairwise)."""
    if cfg.pairs is not None:
        from megaft.eval.pairwise import evaluate_pairs

        return evaluate_pairs(target, cfg)
    os.environ.update(OFFLINE_ENV)
    lm_eval = import_lm_eval()
    manager = task_manager(cfg)
    check_tasks(manager, cfg)
    ensure_tokenizer_config(target.hf_dir)
    args = lm_eval_arguments(target, cfg)
    started = time.monotonic()
    results = lm_eval.simple_evaluate(task_manager=manager, **args)
    if results is None:  # a non-zero rank of a multi-process lm_eval: nothing to write
        return {}
    results.pop("samples", None)
    results["megaft"] = {"model": target.hf_dir, "origin": target.origin, "run_dir": target.run_dir,
                         "tasks": list(cfg.tasks), "include": include_paths(cfg), "arguments": args,
                         "seconds": time.monotonic() - started,
                         "lm_eval_version": getattr(lm_eval, "__version__", None)}
    from lm_eval.utils import handle_non_serializable

    os.makedirs(target.out_dir, exist_ok=True)
    record = json.loads(json.dumps(results, default=handle_non_serializable))
    write_json_atomic(os.path.join(target.out_dir, RESULTS_FILE), record)
    return record
