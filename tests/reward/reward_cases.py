"""Configs and rank functions of the reward-model tests (tests/reward/), in a module without
TRL's imports: the spawned ranks import only this."""
from __future__ import annotations

import json
import os
import random

import torch
import transformers
from train_cases import layout_grid, run  # noqa: F401 (run: the tests import it from here)

from megaft.config import Config
from megaft.validation import resolve

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# what each step's metrics line must repeat of the single process
COMPARED = ("loss", "grad_norm", "accuracy", "margin", "mean_reward", "min_reward", "max_reward", "eval_loss",
            "eval_accuracy")


def write_pairs(path: str, n: int = 12, seed: int = 0, margins: bool = True) -> None:
    """`n` text pairs of different lengths (letters only: the fixture's character vocabulary has
    no space), each with a margin in [0, 1) when `margins`."""
    rng = random.Random(seed)

    def word(lo: int, hi: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for _ in range(n):
            rec = {"prompt": word(2, 6), "chosen": word(1, 7), "rejected": word(1, 6) + "q"}
            if margins:
                rec["margin"] = round(rng.random(), 3)
            f.write(json.dumps(rec) + "\n")


@torch.no_grad()
def make_hf_reward(path: str, causal_lm: str, *, seed: int = 5) -> None:
    """The causal LM of `causal_lm` as a LlamaForSequenceClassification (num_labels=1, a score head
    drawn with std 0.1 from `seed`) in `path`, with its tokenizer: what TRL's RewardTrainer and
    megaft both start from in the comparisons."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=1,
                                                                            dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen) * 0.1)
    model.config.pad_token_id = 0
    model.save_pretrained(path)
    with open(os.path.join(causal_lm, "tokenizer.json")) as src, open(os.path.join(path, "tokenizer.json"), "w") as dst:
        dst.write(src.read())


def reward_config(ckpt: str, pairs: str, steps: int = 3, micro: int = 2) -> Config:
    """A reward run on the tiny checkpoint: 4 pairs a step, constant LR, no weight decay, seq_len 16
    (the pref tests' optimizer settings: Adam's eps 1e-4 bounds how far rounding moves a weight)."""
    cfg = Config()
    cfg.model.init_from, cfg.data.path, cfg.data.seq_len = ckpt, pairs, 16
    cfg.device = "cpu"
    t = cfg.train
    t.objective, t.max_steps, t.global_batch_size, t.micro_batch_size = "reward", steps, 4, micro
    t.progress, t.eval_every, t.tensorboard, t.log_phases = False, 1000, "false", False
    o = cfg.optim
    o.lr = o.min_lr = 1e-2
    o.warmup_steps, o.weight_decay, o.eps = 0, 0.0, 1e-4
    cfg.reward.center_rewards_coefficient = 0.01
    return cfg


# name -> parallel settings, every one on 2 ranks in one spawn
LAYOUTS = {
    "dp2_zero1": dict(dp=2, zero=1),  # micro 1: each dp rank accumulates 2
    "dp2_zero3": dict(dp=2, zero=3),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),  # 2 micro-batches through the 1f1b schedule; the head on the last stage
    "cp2": dict(cp=2),  # the last token on one cp rank
}


# layouts that also export RUN_DIR/hf (the single process too): the stages' and tp shards' files
EXPORTED = ("pp2", "tp2_sp", "dp2_zero1")


def eval_pairs_of(pairs: str) -> str:
    return pairs.replace(".jsonl", ".eval.jsonl")


def layout_config(ckpt: str, pairs: str, name: str, *, single: bool) -> Config:
    """The config of LAYOUTS[name], or (`single`) its single-process reference."""
    par = LAYOUTS[name]
    cfg = reward_config(ckpt, pairs, micro=1 if par.get("dp") else 2)
    cfg.data.eval_path, cfg.train.eval_every = eval_pairs_of(pairs), 2
    cfg.train.export_hf = name in EXPORTED
    if not single:
        for k, v in par.items():
            setattr(cfg.parallel, k, v)
    return resolve(cfg)



def layouts_rank(rank: int, world: int, ckpt: str, pairs: str, root: str) -> None:
    for name, par in LAYOUTS.items():
        cfg = layout_config(ckpt, pairs, name, single=False)
        grid = layout_grid(par)
        run(cfg, grid, os.path.join(root, name))
