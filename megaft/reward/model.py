"""A trained reward model as an RL reward (`rl.reward=[model:DIR]`), as TRL's GRPOTrainer uses a
*ForSequenceClassification in `reward_funcs`: each prompt + completion text tokenized by the
model's own tokenizer without added special tokens, right-padded, and scored by transformers' class.

The reward is read at each row's last real token from the attention mask (megaft.reward.losses),
where TRL reads transformers' logits, found by searching for the pad id: the same token unless
pad == eos and a text ends with the eos token (transformers#35352), where TRL scores the token
before it. The rewards are computed on the CPU in fp32 on every rank (logged rollouts once at the
start, generated ones each step): the same numbers on each, as the other reward functions give.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

PREFIX = "model:"
CONFIG = "config.json"
BATCH_ROWS = 8  # rows per forward


def is_model_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def model_name(spec: str) -> str:
    """TRL's name of a model reward: the folder's last part (rewards/<name>/mean)."""
    return os.path.basename(os.path.normpath(spec[len(PREFIX):]))


def model_problems(spec: str) -> list[str]:
    """Why `model:DIR` cannot score (empty: it can), read from DIR's files without loading weights."""
    path = spec[len(PREFIX):]
    config, tokenizer = os.path.join(path, CONFIG), os.path.join(path, "tokenizer.json")
    if not os.path.isfile(config) or not os.path.isfile(tokenizer):
        return [f"rl.reward entry {spec!r}: {path} has no {CONFIG} and tokenizer.json; fix: the RUN_DIR/hf export "
                "of a train.objective=reward run (docs/reward-models.md)"]
    with open(config) as f:
        raw = json.load(f)
    labels = raw.get("num_labels", len(raw.get("id2label") or {0: 0}))
    if not any(a.endswith("ForSequenceClassification") for a in raw.get("architectures") or []) or labels != 1:
        return [f"rl.reward entry {spec!r}: {config} names no *ForSequenceClassification with one label (architectures "
                f"{raw.get('architectures')}); fix: a reward model (train.objective=reward, train.export_hf=true)"]
    return []


def model_reward(spec: str) -> Callable[..., list]:
    """The reward function of `model:DIR` (TRL's signature); ValueError naming the problem and fix.
    The model loads on the first call."""
    problems = model_problems(spec)
    if problems:
        raise ValueError(problems[0])
    path = spec[len(PREFIX):]
    held: dict = {}

    def reward_model(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        if not held:
            held.update(_load(path))
        return score_texts(held["model"], held["tok"], [p + c for p, c in zip(prompts, completions)])
    reward_model.__name__ = model_name(spec)
    return reward_model


def _load(path: str) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    return {"model": model.eval(), "tok": Tokenizer.from_file(os.path.join(path, "tokenizer.json"))}


@torch.no_grad()
def score_texts(model, tok, texts: list[str], pad_id: Optional[int] = None) -> list[float]:
    """The reward of each text under a transformers *ForSequenceClassification (its backbone and
    `score` head, read at the last real token)."""
    from megaft.reward.losses import last_token_mask, sequence_rewards

    rows = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    pad = pad_id if pad_id is not None else (model.config.pad_token_id or 0)
    out = []
    for start in range(0, len(rows), BATCH_ROWS):
        chunk = rows[start:start + BATCH_ROWS]
        n = max(max(map(len, chunk)), 1)
        ids = torch.full((len(chunk), n), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), n, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r, dtype=torch.long), 1
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        out += sequence_rewards(model.score(hidden).squeeze(-1), last_token_mask(mask)).tolist()
    return out
