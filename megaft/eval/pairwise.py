"""Pairwise accuracy of a reward model on held-out preference pairs (`megaft-eval DIR eval.pairs=FILE`).

The folder is a transformers *ForSequenceClassification (a reward run's export, RUN_DIR/hf). The
pairs are read and tokenized as a reward run reads them (megaft.pref.data: the folder's
tokenizer and chat template, the eos appended to text answers), each pair's two rows scored in
transformers, the reward read at each row's last real token from the attention mask (not by
transformers' search for the pad id, wrong when pad == eos: megaft.reward.losses). Writes the
accuracy (r_chosen > r_rejected), the mean margin and the pair count to OUT/results.json.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from megaft.config.data import DataConfig
from megaft.config.eval import EvalConfig
from megaft.eval.model_dir import CONFIG, EvalError, Target
from megaft.fileio import write_json_atomic
from megaft.pref.data import read_pairs
from megaft.pref.store import pair_tokenizer
from megaft.reward.losses import last_token_mask, sequence_rewards

RESULTS_FILE = "results.json"
TORCH = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_reward_model(hf_dir: str) -> bool:
    """Whether config.json names a *ForSequenceClassification with one label (a reward model)."""
    with open(os.path.join(hf_dir, CONFIG)) as f:
        cfg = json.load(f)
    return any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or []) and \
        cfg.get("num_labels", len(cfg.get("id2label") or {0: 0})) == 1


@torch.no_grad()
def pair_rewards(model, pairs, batch_size: int, device: str) -> torch.Tensor:
    """[pairs, 2] (chosen, rejected) rewards of `pairs` (megaft.pref.data.Pair) under a transformers
    *ForSequenceClassification: its backbone and score head, read at each row's last real token."""
    rows = [p.prompt_ids + side for p in pairs for side in (p.chosen_ids, p.rejected_ids)]
    out = []
    for start in range(0, len(rows), 2 * batch_size):
        chunk = rows[start:start + 2 * batch_size]
        n = max(map(len, chunk))
        ids = torch.zeros(len(chunk), n, dtype=torch.long)
        mask = torch.zeros(len(chunk), n, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        ids, mask = ids.to(device), mask.to(device)
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        scores = model.score(hidden).squeeze(-1)
        out.append(sequence_rewards(scores, last_token_mask(mask)).cpu())
    return torch.cat(out).view(-1, 2)


def evaluate_pairs(target: Target, cfg: EvalConfig) -> dict[str, Any]:
    """Score eval.pairs with the reward model of target.hf_dir; write and return the record."""
    from transformers import AutoModelForSequenceClassification

    if not is_reward_model(target.hf_dir):
        raise EvalError(f"{target.hf_dir} is not a reward model (config.json names no *ForSequenceClassification "
                        "with num_labels 1); fix: eval.pairs reads a train.objective=reward run's export, and a "
                        "causal LM runs eval.tasks")
    if not os.path.isfile(cfg.pairs):
        raise EvalError(f"eval.pairs={cfg.pairs} is not a file; fix: a JSONL of preference pairs (docs/preference.md)")
    started = time.monotonic()
    with open(os.path.join(target.hf_dir, CONFIG)) as f:
        eos_id = json.load(f).get("eos_token_id")
    ptok = pair_tokenizer(DataConfig(), init_from=target.hf_dir, eos_token_id=eos_id)
    pairs = read_pairs(cfg.pairs, ptok.tok, ptok.template, eos_token=ptok.eos_token)
    if not pairs:
        raise EvalError(f"eval.pairs={cfg.pairs} holds no pairs; fix: a JSONL of preference pairs")
    if cfg.limit is not None:
        pairs = pairs[:cfg.limit]
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForSequenceClassification.from_pretrained(target.hf_dir, dtype=TORCH.get(cfg.dtype) or "auto")
    rewards = pair_rewards(model.to(device).eval(), pairs, cfg.batch_size, device)
    diff = rewards[:, 0] - rewards[:, 1]
    record = {"results": {"pairwise": {"accuracy": (diff > 0).double().mean().item(),
                                       "margin": diff.double().mean().item(), "pairs": len(pairs)}},
              "megaft": {"model": target.hf_dir, "origin": target.origin, "run_dir": target.run_dir,
                         "pairs": os.path.abspath(cfg.pairs), "seconds": time.monotonic() - started}}
    os.makedirs(target.out_dir, exist_ok=True)
    write_json_atomic(os.path.join(target.out_dir, RESULTS_FILE), record)
    return record
