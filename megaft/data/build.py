"""From `data.*` to the run's tokenizer, chat encoder and in-memory examples."""
from __future__ import annotations

from typing import NamedTuple, Optional

from tokenizers import Tokenizer

from megaft.config.data import DataConfig, data_sources
from megaft.data.sources import mixture, read_source
from megaft.data.tasks import TASKS, Task, make_task, task_tokenizer
from megaft.data.tokenizer import load_tokenizer


def build_tokenizer(cfg: DataConfig, *, init_from: Optional[str] = None) -> Tokenizer:
    """The run's tokenizer: data.tokenizer, else init_from's tokenizer.json,
    else the character tokenizer of data.task."""
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer)
    if init_from is not None:
        return load_tokenizer(init_from)
    return task_tokenizer(TASKS[cfg.task])


def chat_encoder(cfg: DataConfig, tok: Tokenizer, *, init_from: Optional[str] = None):
    """The run's megaft.data.chat.ChatEncoder for in-memory encoding (encode_examples(...,
    chat=...)), or None when data.chat_template=auto finds no template."""
    from megaft.data.chat import ChatEncoder
    from megaft.data.templates import load_chat_template, tokenizer_dir_of

    template = load_chat_template(cfg.chat_template, tokenizer_dir_of(cfg.tokenizer, init_from))
    return None if template is None else ChatEncoder(tok, template, cfg.train_on)


class Examples(NamedTuple):
    """The run's examples: train and eval dicts, and the Task when generated."""

    train: list[dict]
    eval: list[dict]
    task: Optional[Task]


def load_examples(cfg: DataConfig) -> Examples:
    """Read or generate the examples a DataConfig names.

    train: data.path or data.sources (each source's examples repeated by its
    weight, the epoch-0 mixture of megaft.data.sources.mixture), else the
    generated task's train set. eval: data.eval_path (at most eval_max_lines),
    else the task's held-out set when the task is used for training, else [].
    Deterministic, so every rank can call it. In memory: large data goes through
    megaft.data.prepare instead.
    """
    task = None
    if not data_sources(cfg):
        task = make_task(cfg.task, cfg.task_train_size, cfg.task_eval_size, cfg.seed)
        train, eval_ = task.train, task.eval
    else:
        train, source = [], []
        for i, s in enumerate(data_sources(cfg)):
            part = read_source(s.path)
            train += part
            source += [i] * len(part)
        if cfg.sources:  # data.path alone is the file as it is
            train = [train[j] for j in mixture(source, [s.weight for s in cfg.sources], cfg.seed, 0)]
        eval_ = []
    if cfg.eval_path is not None:
        eval_ = read_source(cfg.eval_path, max_lines=cfg.eval_max_lines)
    return Examples(train, eval_, task)
