"""check_data: every problem of `data.*` before any rank starts (each JSONL/Parquet line parsed,
the tokenizer loaded, the chat template compiled), each with its fix."""
from __future__ import annotations

import os
from typing import Callable, Optional

from megaft.config.data import DataConfig, LongDocs, Packing, TrainOn, data_sources
from megaft.data.build import build_tokenizer
from megaft.data.errors import DataError
from megaft.data.formats import example_texts
from megaft.data.sources import scan_file, source_files, source_problems
from megaft.data.tasks import TASKS
from megaft.data.tokenizer import load_tokenizer
from megaft.data.untrained import UntrainedConversations

MAX_PROBLEMS = 20  # malformed records reported per check, over all sources


def check_data(cfg: DataConfig, *, init_from: Optional[str] = None,
               pairs: Optional[Callable[[str, int], tuple[list[str], bool]]] = None) -> list[str]:
    """Every problem of a DataConfig, each with its fix; [] when usable.

    Runs once in the launcher before any rank starts: it parses every line of
    the JSONL files, so a malformed line is reported as "FILE:LINE: what is
    wrong; fix: ..." here rather than as a crash on all ranks. `init_from` (the
    model's HF checkpoint, if any) tells which tokenizer the run will use. `pairs`: the
    files hold preference pairs or image chats, checked by this (megaft.pref.data.pair_source_problems,
    megaft.data.image_chat.image_source_problems).
    """
    problems = []
    if cfg.seq_len < 2:
        problems.append(f"data.seq_len={cfg.seq_len} is too short; fix: set data.seq_len >= 2")
    if cfg.task not in TASKS:
        problems.append(f"data.task={cfg.task!r} is not a known task; "
                        f"fix: use one of {sorted(TASKS)}")
    elif not data_sources(cfg):
        problems += _task_problems(cfg)
    if cfg.eval_max_lines is not None and cfg.eval_max_lines < 1:
        problems.append(f"data.eval_max_lines={cfg.eval_max_lines}; "
                        "fix: set it >= 1, or null for all lines")
    problems += _option_problems(cfg)
    chat = False
    budget = MAX_PROBLEMS
    for key, path in _scanned(cfg):
        untrained = UntrainedConversations(cfg.train_on)
        found, has_chat = (pairs(path, budget) if pairs is not None
                           else source_problems(path, limit=budget, tally=untrained))
        problems += [f"{key}: {p}" for p in found]
        if not found and pairs is None:  # a source of conversations that all train nothing
            problems += [f"{key}: {p}" for p in untrained.problems(path, list(untrained.records))]
        budget, chat = max(budget - len(found), 0), chat or has_chat
    tokenizer_problems = []
    if cfg.tokenizer is not None:
        tokenizer_problems = _tokenizer_problems(cfg.tokenizer, "data.tokenizer")
    elif init_from is not None and os.path.isdir(init_from):
        # A missing init_from directory is the model config's problem to report.
        tokenizer_problems = _tokenizer_problems(init_from, "the tokenizer of model.init_from")
    elif data_sources(cfg) and cfg.task in TASKS:
        problems += _alphabet_problems(cfg)
    problems += tokenizer_problems
    # The template check may build the tokenizer: only when there is a usable one.
    if not tokenizer_problems and (cfg.task in TASKS or cfg.tokenizer or init_from):
        problems += _template_problems(cfg, init_from, chat)
    return problems


def _scanned(cfg: DataConfig) -> list[tuple[str, str]]:
    """(config key, path) of every source check_data reads."""
    if cfg.sources:
        out = [(f"data.sources[{i}]", s.path) for i, s in enumerate(cfg.sources)]
    else:
        out = [("data.path", cfg.path)] if cfg.path is not None else []
    return out + ([("data.eval_path", cfg.eval_path)] if cfg.eval_path is not None else [])


def _option_problems(cfg: DataConfig) -> list[str]:
    """The fine-tuning fields: enum values, counts and weights."""
    problems = []
    for key, allowed in (("train_on", TrainOn), ("packing", Packing), ("long_docs", LongDocs)):
        if getattr(cfg, key) not in set(allowed):  # a config built in Python
            problems.append(f"data.{key}={getattr(cfg, key)!r} is unknown; "
                            f"fix: use one of {[a.value for a in allowed]}")
    if cfg.chat_template not in ("auto", "llama3", "chatml") and not os.path.isfile(cfg.chat_template):
        problems.append(f"data.chat_template={cfg.chat_template!r} is neither auto, llama3, chatml nor an "
                        "existing .jinja file; fix: use one of those or fix the path")
    if cfg.prepare_workers < 0:
        problems.append(f"data.prepare_workers={cfg.prepare_workers}; fix: set it >= 1, or 0 for min(8, CPUs)")
    if cfg.sources and cfg.path is not None:
        problems.append("data.path and data.sources are both set; fix: list data.path in data.sources "
                        "(or set data.path=null)")
    for i, s in enumerate(cfg.sources):
        if not s.weight > 0:
            problems.append(f"data.sources[{i}].weight={s.weight}; fix: a positive number (times each "
                            "example appears per epoch; drop the source to leave it out)")
    return problems


def _template_problems(cfg: DataConfig, init_from: Optional[str], chat: bool) -> list[str]:
    """The chat template: it must load and compile; conversations need one; a built-in
    template's turn markers must be tokens of the vocabulary."""
    if cfg.chat_template not in ("auto", "llama3", "chatml") and not os.path.isfile(cfg.chat_template):
        return []  # reported by _option_problems
    from megaft.data.chat import check_template_tokens
    from megaft.data.templates import BUILTIN_TOKENS, load_chat_template, tokenizer_dir_of

    try:
        template = load_chat_template(cfg.chat_template, tokenizer_dir_of(cfg.tokenizer, init_from))
    except DataError as e:
        return [f"data.chat_template: {e}"]
    if template is None:
        if not chat:
            return []
        where = tokenizer_dir_of(cfg.tokenizer, init_from) or "the task tokenizer"
        return [f"data.chat_template=auto: the data holds conversations but {where} has no chat template "
                "(chat_template.jinja or tokenizer_config.json's chat_template); fix: set "
                "data.chat_template=llama3, chatml or a .jinja file"]
    if cfg.chat_template in BUILTIN_TOKENS and chat:
        problem = check_template_tokens(build_tokenizer(cfg, init_from=init_from), template,
                                        BUILTIN_TOKENS[cfg.chat_template])
        return [f"data.chat_template: {problem}"] if problem else []
    return []


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
    for key, path in _scanned(cfg):
        unknown = set()
        try:
            files = source_files(path)
        except DataError:
            continue  # reported by the scan
        for file in files:
            for _, ex, _ in scan_file(file):
                for text in example_texts(ex or {}):
                    unknown.update(set(text) - alphabet)
        if unknown:
            shown = "".join(sorted(unknown))[:40]
            problems.append(f"{key}: {path} uses characters outside the {cfg.task!r} task's "
                            f"alphabet ({shown!r}), which its tokenizer maps to <unk>; fix: set "
                            "data.tokenizer or model.init_from")
    return problems
