"""On-policy distillation (distill.lmbda, distill.seq_kd): which steps train on generated completions,
the prompts they are generated from, and the rows they become; TRL 1.16's GKDTrainer.training_step and
generate_on_policy_outputs.

GKD draws, per batch, u < lmbda: the student's own completions (on-policy); else with seq_kd the
teacher's; else the data's. Here the draw is per step and a pure function of (train.seed, step)
(`batch_source`), the same on every rank and in a resumed run; TRL draws python's global `random`
per micro-batch, which no layout-independent run can repeat.

A prompt is an example's tokens before its last run of targets (`prompt_of`): a prompt/completion
line's prompt, a conversation's turns up to the last assistant turn with its header (the chat
template's generation prompt: TRL's `messages[:-1]` with add_generation_prompt). A completion keeps
the eos that ended it and is a target token for token, eos included (TRL's completion_mask up to the
first eos); the prompt is none.
"""
from __future__ import annotations

import random
from typing import Sequence

import numpy as np
import torch

from megaft.pref.batches import row_of

__all__ = ["DATA", "METRICS", "STUDENT", "TEACHER", "batch_source", "generated_rows", "prompt_of"]

DATA, STUDENT, TEACHER = "data", "student", "teacher"  # who wrote a step's completions
# a step's metrics: 1 when the student wrote its completions (0: the data or, with seq_kd, the teacher), and
# with seq_kd 1 when the teacher did
METRICS = ("on_policy", "teacher_completions")


def batch_source(seed: int, step: int, lmbda: float, seq_kd: bool) -> str:
    """Whose completions step `step` (0-based) trains on: STUDENT with probability lmbda, else TEACHER
    with seq_kd, else DATA (GKDTrainer.training_step's order)."""
    if lmbda > 0 and random.Random(seed * 1_000_003 + step).random() < lmbda:
        return STUDENT
    return TEACHER if seq_kd else DATA


def prompt_of(ids: Sequence[int], target: Sequence[bool], seq_len: int) -> list[int]:
    """The tokens of an example before its last run of targets (all of them when it has none), at most
    seq_len - 1 of them, the last ones (TRL's collator keeps a long example's end), so a completion has room."""
    mask = np.asarray(target, dtype=bool)
    hits = np.flatnonzero(mask)
    end = len(ids)
    if len(hits):
        end = int(hits[-1])
        while end > 0 and mask[end - 1]:
            end -= 1
    prompt = [int(t) for t in ids[:end]]
    return prompt[-(seq_len - 1):]


def generated_rows(prompts: list[list[int]], completions: list[list[int]], seq_len: int,
                   pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [rows, seq_len] of prompt + completion, the labels on the completion's tokens only
    (megaft's shifted labels: labels[:, t] is position t's next token)."""
    rows = [row_of(p, c, seq_len, pad_id) for p, c in zip(prompts, completions)]
    return torch.tensor([r[0] for r in rows], dtype=torch.long), torch.tensor([r[1] for r in rows], dtype=torch.long)
