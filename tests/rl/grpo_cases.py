"""Configs and rank functions of the GRPO training tests (tests/rl/test_grpo_training.py), in a
module without TRL's imports: the spawned ranks import only this."""
from __future__ import annotations

import json
import os
import random

from train_cases import layout_grid, run  # noqa: F401 (run: the tests import it from here)

from megaft.config import Config
from megaft.validation import resolve

G = 4  # completions per prompt
# name -> parallel settings (and loss_type), every one on 2 ranks in one spawn
LAYOUTS = {
    "dapo_dp2_zero3": (dict(dp=2, zero=3), "dapo"),
    "dapo_tp2_sp": (dict(tp=2, sequence_parallel=True), "dapo"),
    "dapo_cp2": (dict(cp=2), "dapo"),
    "dapo_pp2": (dict(pp=2), "dapo"),
    "grpo_dp2": (dict(dp=2, zero=1), "grpo"),
    "grpo_cp2": (dict(cp=2), "grpo"),
    "dr_grpo_tp2": (dict(tp=2), "dr_grpo"),
    "bnpo_pp2": (dict(pp=2), "bnpo"),
    # rl.beta > 0: the KL term against rl.reference (another checkpoint), or the starting model
    "dapo_kl_ref_dp2_zero3": (dict(dp=2, zero=3), "dapo"),
    "dapo_kl_ref_tp2_sp": (dict(tp=2, sequence_parallel=True), "dapo"),
    "grpo_kl_ref_pp2": (dict(pp=2), "grpo"),
    "dapo_kl_ref_cp2": (dict(cp=2), "dapo"),
    "dapo_kl_lora_tp2": (dict(tp=2), "dapo"),
    # the fixture's Mixtral (its router aux loss over each micro-batch's tokens): experts over 2 ranks
    "dapo_moe_ep2": (dict(dp=2, ep=2), "dapo"),
}
BETA = 0.04


def write_rollouts(path: str, vocab: int, n: int = 6, seed: int = 0) -> None:
    """`n` prompts with G completions of very different lengths and rewards (one declined)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))]
            completions = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 8))] for _ in range(G)]
            rewards = [float(rng.randint(0, 3)) for _ in range(G)]
            if i == 2:
                rewards[1] = None
            f.write(json.dumps({"prompt_ids": prompt, "completion_ids": completions, "rewards": rewards}) + "\n")


def grpo_config(ckpt: str, rollouts: str, loss_type: str = "dapo", steps: int = 3, micro: int = 4) -> Config:
    """GRPO on the tiny checkpoint: 8 completions (2 groups) a step, constant LR, no weight decay."""
    cfg = Config()
    cfg.model.init_from, cfg.data.seq_len, cfg.device = ckpt, 16, "cpu"
    cfg.rl.rollouts, cfg.rl.num_generations, cfg.rl.max_completion_length = rollouts, G, 8
    cfg.rl.loss_type, cfg.rl.epsilon_high = loss_type, 0.28
    t = cfg.train
    t.objective, t.max_steps, t.global_batch_size, t.micro_batch_size = "grpo", steps, 2 * G, micro
    t.progress, t.eval_every, t.tensorboard, t.log_phases = False, 1000, "false", False
    o = cfg.optim
    o.lr = o.min_lr = 1e-2
    o.warmup_steps, o.weight_decay, o.eps = 0, 0.0, 1e-4  # eps: see tests/pref/pref_train_cases.py
    return cfg


def reference_of(ckpt: str) -> str:
    """The other checkpoint the fixture saves beside `ckpt` (rl.reference's tests)."""
    return os.path.join(os.path.dirname(ckpt), "ref")


def single_name(name: str) -> str:
    """The single-process run a layout compares with."""
    _, loss_type = LAYOUTS[name]
    kl = "_kl_ref" if "_kl_ref" in name else "_kl_lora" if "_kl_lora" in name else ""
    return f"single_{loss_type}{kl}" + ("_moe" if "_moe" in name else "")


def moe_of(ckpt: str) -> str:
    """The Mixtral checkpoint the fixture saves beside `ckpt`."""
    return os.path.join(os.path.dirname(ckpt), "moe")


def kl_config(ckpt: str, rollouts: str, loss_type: str, kl: str, micro: int = 4) -> Config:
    """grpo_config with the KL term: kl "_kl_ref" against rl.reference, "_kl_lora" LoRA against its base."""
    cfg = grpo_config(ckpt, rollouts, loss_type, micro=micro)
    if kl:
        cfg.rl.beta = BETA
    if kl == "_kl_ref":
        cfg.rl.reference = reference_of(ckpt)
    if kl == "_kl_lora":
        cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    return cfg


def layout_config(ckpt: str, rollouts: str, name: str, *, single: bool) -> Config:
    par, loss_type = LAYOUTS[name]
    kl = single_name(name)[len(f"single_{loss_type}"):].removesuffix("_moe")
    cfg = kl_config(moe_of(ckpt) if "_moe" in name else ckpt, rollouts, loss_type, kl, micro=2 if par.get("dp") else 4)
    if not single:
        for k, v in par.items():
            setattr(cfg.parallel, k, v)
    return resolve(cfg)



def layouts_rank(rank: int, world: int, ckpt: str, rollouts: str, root: str) -> None:
    for name, (par, _) in LAYOUTS.items():
        cfg = layout_config(ckpt, rollouts, name, single=False)
        grid = layout_grid(par)
        run(cfg, grid, os.path.join(root, name))


def letters(completions: list[str], answer: list, **kwargs) -> list[float]:
    """A reward that varies on a random model's samples: the completion's characters found in `answer`."""
    return [float(sum(ch in a for ch in c)) for c, a in zip(completions, answer)]


ONLINE_REWARD = "rl.grpo_cases:letters"


def write_prompts(path: str, n: int = 6, seed: int = 0) -> None:
    """`n` text prompts of 2-5 characters, each with an "answer" of 6 characters (letters' reference)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5)))
            f.write(json.dumps({"prompt": prompt, "answer": "".join(rng.sample(alphabet, 6))}) + "\n")


def online_config(ckpt: str, prompts: str, loss_type: str = "dapo", steps: int = 3, micro: int = 4) -> Config:
    """grpo_config generating its rollouts from rl.prompts (2 prompts x G a step), scored by `letters`."""
    cfg = grpo_config(ckpt, None, loss_type, steps, micro)
    cfg.rl.prompts, cfg.rl.reward = prompts, [ONLINE_REWARD]
    return cfg


# name -> parallel settings of the online runs on 2 ranks (each against the single online run; "lora" in
# the name: LoRA adapters, against the single LoRA run)
ONLINE_LAYOUTS = {"online_dp2_zero3": dict(dp=2, zero=3), "online_tp2_sp": dict(tp=2, sequence_parallel=True),
                  "online_pp2": dict(pp=2), "online_cp2": dict(cp=2), "online_lora_tp2": dict(tp=2)}


def online_layout_config(ckpt: str, prompts: str, name: str, par: dict) -> Config:
    """online_config at a layout of ONLINE_LAYOUTS (par = {}: its single process)."""
    cfg = online_config(ckpt, prompts, micro=2 if par.get("dp") else 4)
    if "lora" in name:
        cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def online_rank(rank: int, world: int, ckpt: str, prompts: str, root: str) -> None:
    for name, par in ONLINE_LAYOUTS.items():
        cfg = online_layout_config(ckpt, prompts, name, par)
        grid = layout_grid(par)
        run(resolve(cfg), grid, os.path.join(root, name))
