"""Reward functions (`rl.reward=[...]`): Python functions with TRL's signature, named in config, and
the built-in ones.

A reward function takes the batch's `prompts` and `completions` (decoded text), `completion_ids`,
and every extra field of the samples (e.g. `answer`) as keyword lists, one value per completion,
and returns one float per completion or None where it does not apply (TRL's GRPOTrainer calls
them so: trl/trainer/grpo_trainer.py `_calculate_rewards`). `rl.reward` names each as
`package.module:function` (importable where the ranks run) or a built-in:

    exact_match   1.0 when the completion's final answer equals the sample's `answer`, else 0.0;
                  the final answer is the last \\boxed{...}, else what follows the last "####",
                  else the last non-empty line, compared stripped
    math          TRL's accuracy_reward: 1.0 when Hugging Face's math-verify finds the completion's
                  LaTeX answer equal to the sample's `solution` (else `answer`), 0.0 where not, None
                  where the gold does not parse (megaft.rl.math_reward)
    format        1.0 when the completion matches rl.format_pattern (re.match, DOTALL and
                  MULTILINE), else 0.0; the default pattern is TRL's think_format_reward's
    model:DIR     a trained reward model (a train.objective=reward run's RUN_DIR/hf): its score of
                  prompt + completion, as TRL scores with a model in reward_funcs (megaft.reward.model)

`rl.reward_weights` weighs them (default 1 each). A function that raises is named with the
sample it failed on, and the step is not taken (RewardError).
"""
from __future__ import annotations

import importlib
import math
import re
from typing import Callable, Optional

import torch

from megaft.config.rl import THINK_FORMAT
from megaft.reward.model import is_model_spec, model_name, model_reward
from megaft.rl.math_reward import check_available, math_reward

RewardFn = Callable[..., list]


class RewardError(RuntimeError):
    """A reward function failed, or returned what is not one float or None per completion."""


def final_answer(text: str) -> str:
    """The completion's final answer: the last \\boxed{...}, else after the last "####", else its last
    non-empty line."""
    boxed = re.findall(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", text)
    if boxed:
        return boxed[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def exact_match(completions: list[str], answer: list, **kwargs) -> list[Optional[float]]:
    """1.0 where the final answer equals the sample's `answer` (stripped), 0.0 elsewhere; None
    for a sample without one."""
    return [None if a is None else float(final_answer(c) == str(a).strip()) for c, a in zip(completions, answer)]


def format_reward(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL | re.MULTILINE)

    def format(completions: list[str], **kwargs) -> list[float]:  # noqa: A001 - TRL logs the function's name
        return [1.0 if compiled.match(c) else 0.0 for c in completions]
    return format


def load_reward(spec: str, format_pattern: str = THINK_FORMAT) -> RewardFn:
    """The function `spec` names: a built-in, or `package.module:function`; ValueError with the fix."""
    if spec == "exact_match":
        return exact_match
    if spec == "format":
        return format_reward(format_pattern)
    if spec == "math":
        check_available()
        return math_reward
    if is_model_spec(spec):  # a trained reward model (megaft.reward.model)
        return model_reward(spec)
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"rl.reward entry {spec!r} is neither a built-in (exact_match, math, format) nor "
                         "package.module:function; fix: name one of those")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"rl.reward entry {spec!r} does not import ({type(exc).__name__}: {exc}); fix: make "
                         f"{module} importable where the ranks run (PYTHONPATH), and check the name") from None
    if not callable(fn):
        raise ValueError(f"rl.reward entry {spec!r} is not a function")
    return fn


def reward_name(spec: str) -> str:
    """The name TRL logs a function under (rewards/<name>/mean); a reward model's: its folder's name."""
    if is_model_spec(spec):
        return model_name(spec)
    return spec.rpartition(":")[2] if ":" in spec else spec


def score(functions: list[tuple[str, RewardFn]], prompts: list[str], completions: list[str],
          completion_ids: list[list[int]], extras: dict[str, list]) -> torch.Tensor:
    """[completions, functions] rewards (NaN where a function returned None)."""
    out = torch.full((len(completions), len(functions)), math.nan, dtype=torch.float32)
    for j, (spec, fn) in enumerate(functions):
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **extras)
        except Exception as exc:  # noqa: BLE001 - named with the function, re-raised
            raise RewardError(f"rl.reward {spec!r} raised {type(exc).__name__}: {exc} (on a batch whose first "
                              f"prompt is {prompts[0][:80]!r}); the step is not taken") from exc
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            raise RewardError(f"rl.reward {spec!r} returned {type(values).__name__} of "
                              f"{len(values) if hasattr(values, '__len__') else '?'} values for {len(completions)} "
                              "completions; fix: one float (or None) per completion")
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardError(f"rl.reward {spec!r} returned {v!r} for completion {i} (prompt "
                                  f"{prompts[i][:80]!r}); fix: a finite float or None")
            out[i, j] = float(v)
    return out
