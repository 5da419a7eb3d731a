"""The checks of `eval.*` and of `train.then_eval`: the task names against the task YAMLs of
megaft (megaft/eval/tasks), eval.include and lm_eval's index, each problem with its fix."""
from __future__ import annotations

import os

from megaft.config.eval import EvalConfig


def tasks_dir() -> str:
    """The example tasks shipped with megaft (megaft_arith, megaft_copy)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def include_paths(cfg: EvalConfig) -> list[str]:
    """Where task YAMLs are looked up besides lm_eval's own: megaft's, then eval.include."""
    return [tasks_dir()] + ([os.path.abspath(os.path.expanduser(cfg.include))] if cfg.include else [])


def local_task_names(paths: list[str]) -> set[str]:
    """Task, group and tag names declared by the YAML files under `paths` (a quick scan
    that needs no lm_eval; lm_eval's TaskManager indexes the same files)."""
    import yaml

    class _Loader(yaml.SafeLoader):  # `!function x.y` tags: any value will do for a scan
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    names: set[str] = set()
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                if not name.endswith((".yaml", ".yml")):
                    continue
                try:
                    with open(os.path.join(dirpath, name)) as f:
                        doc = yaml.load(f, Loader=_Loader)
                except (OSError, yaml.YAMLError):
                    continue
                if isinstance(doc, dict):
                    for key in ("task", "group", "tag"):
                        value = doc.get(key)
                        names.update([value] if isinstance(value, str) else
                                     [v for v in value or () if isinstance(v, str)] if isinstance(value, list) else [])
    return names


def unknown_tasks(cfg: EvalConfig) -> tuple[list[str], list[str]]:
    """(eval.tasks that no YAML declares, the names that are known): megaft's and eval.include's
    tasks first; lm_eval's built-in index is read only when one is not among them."""
    local = local_task_names(include_paths(cfg))
    missing = [t for t in cfg.tasks if t not in local]
    if not missing:
        return [], sorted(local)
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        return missing, sorted(local)
    known = set(TaskManager(include_path=include_paths(cfg)).all_tasks)
    return [t for t in missing if t not in known], sorted(local)


def check_eval(cfg: EvalConfig, *, need_tasks: bool = True) -> list[str]:
    """Problems of eval.* (every one, each with its fix)."""
    problems = []
    if cfg.include and not os.path.isdir(os.path.expanduser(cfg.include)):
        problems.append(f"eval.include={cfg.include!r} is not a directory; fix: a folder of lm_eval task YAMLs")
    if cfg.batch_size < 1:
        problems.append(f"eval.batch_size={cfg.batch_size} must be >= 1; fix: e.g. eval.batch_size=8")
    if cfg.limit is not None and cfg.limit < 1:
        problems.append(f"eval.limit={cfg.limit} must be >= 1 or null (all documents)")
    if cfg.timeout_min < 1:
        problems.append(f"eval.timeout_min={cfg.timeout_min} must be >= 1 (minutes)")
    if cfg.pairs is not None and cfg.tasks:
        problems.append("eval.pairs scores a reward model and eval.tasks runs lm_eval on a causal LM; fix: one of "
                        "them (eval.tasks=[] with eval.pairs)")
    if need_tasks and not cfg.tasks and cfg.pairs is None:
        problems.append("eval.tasks is empty; fix: e.g. eval.tasks=[megaft_arith,megaft_copy] (the examples in "
                        "megaft/eval/tasks) or your own with eval.include=DIR")
    if problems or not cfg.tasks:
        return problems
    unknown, local = unknown_tasks(cfg)
    if unknown:
        problems.append(f"eval.tasks: unknown task(s) {', '.join(unknown)}; available here: {', '.join(local)} "
                        "(plus lm_eval's built-in tasks, which need their data sets in the local cache); fix: "
                        "a task name from a YAML's `task:`, or eval.include=DIR with its YAML")
    return problems


def check_then_eval(cfg: EvalConfig, *, then_eval: bool, export_hf: bool, lora_rank: int, export_merged: bool,
                    save_every: int) -> list[str]:
    """Problems of train.then_eval: the run must leave a model megaft-eval can read (an HF
    export, the merged one under LoRA, or a checkpoint to export), and eval.* must be valid."""
    if not then_eval:
        return []
    problems = []
    if lora_rank > 0 and not (export_hf and export_merged) and not save_every:
        problems.append("train.then_eval=true under LoRA evaluates the merged model; fix: train.export_hf=true "
                        "lora.export_merged=true (or train.save_every=N: megaft-eval exports the last checkpoint)")
    elif lora_rank == 0 and not export_hf and not save_every:
        problems.append("train.then_eval=true needs a model to evaluate; fix: train.export_hf=true (or "
                        "train.save_every=N: megaft-eval exports the last checkpoint)")
    return problems + check_eval(cfg)
