"""Configs and the rank function of tests/rl/test_grpo_settings.py (rl.num_iterations,
rl.mask_truncated_completions, rl.top_p), in a module without TRL's imports: the spawned ranks
import only this."""
from __future__ import annotations

import json
import os
import random

from rl.grpo_cases import G, grpo_config, online_config
from train_cases import layout_grid, run

from megaft.config import Config
from megaft.validation import resolve

EOS = 1  # the fixture tokenizer's <eos>


def write_ended_rollouts(path: str, vocab: int, n: int = 6, seed: int = 5) -> None:
    """As grpo_cases.write_rollouts, but about half the completions end with the eos (the others
    were cut at their limit: rl.mask_truncated_completions drops them)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))]
            completions = []
            for _ in range(G):
                c = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 7))]
                completions.append(c + [EOS] if rng.random() < 0.5 else c)
            rewards = [float(rng.randint(0, 3)) for _ in range(G)]
            f.write(json.dumps({"prompt_ids": prompt, "completion_ids": completions, "rewards": rewards}) + "\n")


def settings_config(ckpt: str, rollouts: str, prompts: str, what: str, micro: int = 4) -> Config:
    """The run `what`: mu2 (rl.num_iterations=2, 4 steps: two generations), trunc
    (rl.mask_truncated_completions), top_p (online at rl.top_p=0.7), online_mu2 (online, mu 2)."""
    if what == "mu2":
        cfg = grpo_config(ckpt, rollouts, "dapo", steps=4, micro=micro)
        cfg.rl.num_iterations = 2
    elif what == "trunc":
        cfg = grpo_config(ckpt, rollouts, "dapo", steps=2, micro=micro)
        cfg.rl.mask_truncated_completions = True
    elif what == "top_p":
        cfg = online_config(ckpt, prompts, steps=2, micro=micro)
        cfg.rl.top_p = 0.7
    else:
        cfg = online_config(ckpt, prompts, steps=4, micro=micro)
        cfg.rl.num_iterations = 2
    return cfg


SINGLES = ("mu2", "trunc", "top_p", "online_mu2")
# the 2-rank runs: name -> (the single-process run it equals, parallel settings)
LAYOUTS = {"mu2_dp2_zero3": ("mu2", dict(dp=2, zero=3)), "mu2_pp2": ("mu2", dict(pp=2)),
           "trunc_cp2": ("trunc", dict(cp=2)), "top_p_tp2_sp": ("top_p", dict(tp=2, sequence_parallel=True)),
           "online_mu2_dp2": ("online_mu2", dict(dp=2, zero=1))}


RESUMED = dict(dp=2, zero=3)  # mu2 stopped inside generation 1 and resumed: each rank reads its own rl_state file


def settings_rank(rank: int, world: int, ckpt: str, rollouts: str, prompts: str, root: str) -> None:
    for name, (what, par) in LAYOUTS.items():
        cfg = settings_config(ckpt, rollouts, prompts, what, micro=2 if par.get("dp") else 4)
        for k, v in par.items():
            setattr(cfg.parallel, k, v)
        run(resolve(cfg), layout_grid(par), os.path.join(root, name))
    for steps in (3, 4):  # a checkpoint after step 3 (generation 1's first), then on to step 4 from it
        cfg = settings_config(ckpt, rollouts, prompts, "mu2", micro=2)
        cfg.train.max_steps, cfg.train.save_every = steps, 3
        for k, v in RESUMED.items():
            setattr(cfg.parallel, k, v)
        run(resolve(cfg), layout_grid(RESUMED), os.path.join(root, "mu2_dp2_resumed"))
