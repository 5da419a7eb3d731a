"""DataConfig, its validation, and turning it into a tokenizer and examples."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

from tokenizers import Tokenizer

from megaft.data.errors import DataError
from megaft.data.jsonl import jsonl_problems, read_jsonl, scan_jsonl
from megaft.data.tasks import TASKS, Task, make_task, task_tokenizer
from megaft.data.tokenizer import load_tokenizer


@dataclass
class DataConfig:
    """Where examples come from and how they are cut into sequences."""

    path: Optional[str] = None  # JSONL train file (see megaft.data.jsonl); None = generated task
    eval_path: Optional[str] = None  # JSONL eval file; None = task's held-out set (none for files)
    tokenizer: Optional[str] = None  # tokenizer.json or its dir; None = init_from's, else task's
    seq_len: int = 64  # tokens per packed training sequence
    task: str = "addition"  # generated task used when path is None (see megaft.data.tasks.TASKS)
    task_train_size: int = 20000  # generated training examples (repeats allowed)
    task_eval_size: int = 256  # generated held-out prompts, never in the training set
    seed: int = 1234  # generates the task and shuffles each epoch's packing order
    eval_max_lines: Optional[int] = None  # read at most this many examples of eval_path; None = all


def check_data(cfg: DataConfig, *, init_from: Optional[str] = None) -> list[str]:
    """Every problem of a DataConfig, each with its fix; [] when usable.

    Runs once in the launcher before any rank starts: it parses every line of
    the JSONL files, so a malformed line is reported as "FILE:LINE: what is
    wrong; fix: ..." here rather than as a crash on all ranks. `init_from` (the
    model's HF checkpoint, if any) tells which tokenizer the run will use.
    """
    problems = []
    if cfg.seq_len < 2:
        problems.append(f"data.seq_len={cfg.seq_len} is too short; fix: set data.seq_len >= 2")
    if cfg.task not in TASKS:
        problems.append(f"data.task={cfg.task!r} is not a known task; "
                        f"fix: use one of {sorted(TASKS)}")
    elif cfg.path is None:
        problems += _task_problems(cfg)
    if cfg.eval_max_lines is not None and cfg.eval_max_lines < 1:
        problems.append(f"data.eval_max_lines={cfg.eval_max_lines}; "
                        "fix: set it >= 1, or null for all lines")
    for key in ("path", "eval_path"):
        if getattr(cfg, key) is not None:
            problems += [f"data.{key}: {p}" for p in jsonl_problems(getattr(cfg, key))]
    if cfg.tokenizer is not None:
        problems += _tokenizer_problems(cfg.tokenizer, "data.tokenizer")
    elif init_from is not None and os.path.isdir(init_from):
        # A missing init_from directory is the model config's problem to report.
        problems += _tokenizer_problems(init_from, "the tokenizer of model.init_from")
    elif cfg.path is not None and cfg.task in TASKS:
        problems += _alphabet_problems(cfg)
    return problems


def _task_problems(cfg: DataConfig) -> list[str]:
    spec, problems = TASKS[cfg.task], []
    if cfg.task_train_size < 1:
        problems.append(f"data.task_train_size={cfg.task_train_size}; fix: set it >= 1")
    if not 0 <= cfg.task_eval_size <= spec.max_eval_size:
        problems.append(f"data.task_eval_size={cfg.task_eval_size} but task {cfg.task!r} "
                        f"holds out at most half its {spec.num_prompts} prompts; "
                        f"fix: set it in [0, {spec.max_eval_size}]")
    return problems


def _tokenizer_problems(path: str, what: str) -> list[str]:
    try:
        load_tokenizer(path)
    except DataError as e:
        return [f"{what}: {e}"]
    return []


def _alphabet_problems(cfg: DataConfig) -> list[str]:
    """With no tokenizer set, file data goes through the task's character
    tokenizer: characters outside its alphabet would silently become <unk>."""
    alphabet, problems = set(TASKS[cfg.task].alphabet), []
    for key in ("path", "eval_path"):
        path, unknown = getattr(cfg, key), set()
        if path is None:
            continue
        for _, ex, _ in scan_jsonl(path):
            for text in (ex or {}).values():
                unknown.update(set(text) - alphabet)
        if unknown:
            shown = "".join(sorted(unknown))[:40]
            problems.append(f"data.{key}: {path} uses characters outside the {cfg.task!r} task's "
                            f"alphabet ({shown!r}), which its tokenizer maps to <unk>; fix: set "
                            "data.tokenizer or model.init_from")
    return problems


def build_tokenizer(cfg: DataConfig, *, init_from: Optional[str] = None) -> Tokenizer:
    """The run's tokenizer: data.tokenizer, else init_from's tokenizer.json,
    else the character tokenizer of data.task."""
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer)
    if init_from is not None:
        return load_tokenizer(init_from)
    return task_tokenizer(TASKS[cfg.task])


class Examples(NamedTuple):
    """The run's examples: train and eval dicts, and the Task when generated."""

    train: list[dict]
    eval: list[dict]
    task: Optional[Task]


def load_examples(cfg: DataConfig) -> Examples:
    """Read or generate the examples a DataConfig names.

    train: data.path, else the generated task's train set. eval: data.eval_path
    (at most eval_max_lines), else the task's held-out set when the task is
    used for training, else []. Deterministic, so every rank can call it.
    """
    task = None
    if cfg.path is None:
        task = make_task(cfg.task, cfg.task_train_size, cfg.task_eval_size, cfg.seed)
        train, eval_ = task.train, task.eval
    else:
        train, eval_ = read_jsonl(cfg.path), []
    if cfg.eval_path is not None:
        eval_ = read_jsonl(cfg.eval_path, max_lines=cfg.eval_max_lines)
    return Examples(train, eval_, task)
