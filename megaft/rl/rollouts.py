"""Logged rollouts (`rl.rollouts=FILE`): read instead of generated, for rollouts made elsewhere
and for exact tests. One prompt a line:

    {"prompt_ids": [int, ...], "completion_ids": [[int, ...] x G], "rewards": [float | null x G]}

G = rl.num_generations completions of the prompt with their rewards (null: the reward function
declined the completion, as a TRL reward function returning None; a completion every function
declined has advantage 0). With rl.reward set the lines carry no "rewards": the functions score
the decoded completions, each extra field of the line (e.g. "answer") passed to them.

A step's global batch is whole groups, taken in the file's order and from its start again when
it runs out: a pure function of the step, so a resumed run reads what the uninterrupted one did.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megaft.pref.batches import row_of


@dataclass(frozen=True)
class Group:
    """One prompt's G completions and their rewards (None: declined)."""

    prompt_ids: list[int]
    completion_ids: list[list[int]]
    rewards: Optional[list[Optional[float]]]  # None: scored by rl.reward
    extras: dict  # the line's other fields, for the reward functions


def _ids(value, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and t >= 0 for t in value):
        raise ValueError(f"{what} must be a non-empty list of token ids (ints >= 0)")
    return value


KEYS = ("prompt_ids", "completion_ids", "rewards")


def parse_group(line: str, num_generations: int, max_completion_length: int, seq_len: int,
                vocab_size: Optional[int] = None, scored: bool = False) -> Group:
    """One line's group; ValueError naming what is wrong. `scored`: rl.reward scores it (no "rewards")."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    missing = [k for k in KEYS[:2] + (() if scored else KEYS[2:]) if k not in record]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}" + ("" if scored else " (or name rl.reward functions)"))
    if scored and "rewards" in record:
        raise ValueError('has "rewards" and rl.reward scores the completions too; fix: drop one of them')
    prompt = _ids(record["prompt_ids"], "prompt_ids")
    completions = record["completion_ids"]
    rewards = [0.0] * num_generations if scored else record["rewards"]
    if not isinstance(completions, list) or len(completions) != num_generations:
        raise ValueError(f"completion_ids must hold rl.num_generations={num_generations} completions")
    if not isinstance(rewards, list) or len(rewards) != num_generations:
        raise ValueError(f"rewards must hold rl.num_generations={num_generations} numbers (or null)")
    completions = [_ids(c, f"completion_ids[{g}]") for g, c in enumerate(completions)]
    for g, (c, r) in enumerate(zip(completions, rewards)):
        if len(c) > max_completion_length:
            raise ValueError(f"completion {g} has {len(c)} tokens > rl.max_completion_length={max_completion_length}")
        if len(prompt) + len(c) > seq_len:
            raise ValueError(f"prompt + completion {g} is {len(prompt) + len(c)} tokens > data.seq_len={seq_len}")
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)):
            raise ValueError(f"rewards[{g}]={r!r} must be a finite number or null")
    if vocab_size is not None:
        top = max(max(prompt), *(max(c) for c in completions))
        if top >= vocab_size:
            raise ValueError(f"token id {top} is outside the model's vocabulary of {vocab_size}")
    extras = {k: v for k, v in record.items() if k not in KEYS}
    return Group(prompt, completions, None if scored else [None if r is None else float(r) for r in rewards], extras)


def read_rollouts(path: str, num_generations: int, max_completion_length: int, seq_len: int,
                  vocab_size: Optional[int] = None, scored: bool = False) -> list[Group]:
    """Every group of `path`; ValueError listing the first problems with their line numbers."""
    groups, problems = [], []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                groups.append(parse_group(line, num_generations, max_completion_length, seq_len, vocab_size, scored))
            except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
                problems.append(f"{path}:{n}: {exc}")
                if len(problems) == 5:
                    break
    if not groups and not problems:
        problems.append(f"{path} holds no rollouts")
    if problems:
        raise ValueError("rl.rollouts: " + "; ".join(problems) + "; fix the file (docs/rl.md: one "
                         '{"prompt_ids", "completion_ids", "rewards"} object a line)')
    return groups


def step_groups(n_groups: int, step: int, groups_per_step: int) -> list[int]:
    """The indices of step `step`'s groups (0-based, the Trainer's count): the next `groups_per_step`
    in file order, wrapping."""
    start = step * groups_per_step
    return [(start + j) % n_groups for j in range(groups_per_step)]


def group_rows(groups: list[Group], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of the groups' completions [G x groups rows, seq_len], in group order:
    prompt + completion, the labels on the completion's tokens only (megaft.pref.batches.row_of)."""
    rows = [row_of(g.prompt_ids, c, seq_len, pad_id) for g in groups for c in g.completion_ids]
    return torch.tensor([r[0] for r in rows], dtype=torch.long), torch.tensor([r[1] for r in rows], dtype=torch.long)


def logged_rewards(groups: list[Group]) -> torch.Tensor:
    """The lines' own rewards [completions, 1] in group order, NaN where declined."""
    return torch.tensor([[math.nan if r is None else r] for g in groups for r in g.rewards], dtype=torch.float32)


def scored_rewards(groups: list[Group], functions: list, decode) -> torch.Tensor:
    """[completions, functions] rewards of rl.reward's functions (megaft.rl.rewards.score) on the decoded
    prompts and completions, each line's extra fields repeated for its G completions."""
    from megaft.rl.rewards import score

    prompts = [decode(g.prompt_ids) for g in groups for _ in g.completion_ids]
    completions = [decode(c) for g in groups for c in g.completion_ids]
    keys = sorted({k for g in groups for k in g.extras})
    extras = {k: [g.extras.get(k) for g in groups for _ in g.completion_ids] for k in keys}
    return score(functions, prompts, completions, [c for g in groups for c in g.completion_ids], extras)
