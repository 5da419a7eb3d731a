"""Configs and rank functions of the distillation runs (tests/distill/), in a module without TRL's
imports: the spawned ranks import only this."""
from __future__ import annotations

import json
import os
import random
from typing import Optional

import torch
import transformers
from models.hf_fixture import hf_config, write_char_tokenizer
from train_cases import layout_grid, run

from megaft.config import Config
from megaft.validation import resolve

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
COMPARED = ("loss", "grad_norm")


def write_sft(path: str, n: int = 16, seed: int = 0, prompt_len: Optional[int] = None) -> None:
    """`n` prompt/completion lines of different lengths (letters only: the fixture's character vocabulary);
    `prompt_len`: every prompt that long."""
    rng = random.Random(seed)

    def word(lo: int, hi: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for _ in range(n):
            prompt = word(prompt_len, prompt_len) if prompt_len else word(2, 6)
            f.write(json.dumps({"prompt": prompt, "completion": word(2, 8)}) + "\n")


def distill_config(ckpt: str, teacher: str, data: str, *, beta: float = 0.5, temperature: float = 2.0,
                   alpha: float = 0.0, steps: int = 2, micro: int = 2, packing: str = "none") -> Config:
    """A distillation run of the tiny student on `data`: 4 sequences a step, constant LR, no weight decay."""
    cfg = Config()
    cfg.model.init_from, cfg.data.path, cfg.data.seq_len, cfg.data.packing = ckpt, data, 16, packing
    cfg.device = "cpu"
    t = cfg.train
    t.objective, t.max_steps, t.global_batch_size, t.micro_batch_size = "distill", steps, 4, micro
    t.progress, t.eval_every, t.tensorboard, t.log_phases = False, 1000, "false", False
    o = cfg.optim
    o.lr = o.min_lr = 1e-2
    o.warmup_steps, o.weight_decay, o.eps = 0, 0.0, 1e-4
    d = cfg.distill
    d.teacher, d.loss, d.beta, d.temperature, d.alpha = teacher, "jsd", beta, temperature, alpha
    d.chunk_tokens = 5  # several chunks a micro-batch
    return cfg


# name -> parallel settings, every one on 2 ranks in one spawn
LAYOUTS = {
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
    "dp2_zero3": dict(dp=2, zero=3),
    "cp2": dict(cp=2),
    # packed data (the sft data part's): whole documents kept apart in attention, and one causal stream
    "tp2_sp_docs": dict(tp=2, sequence_parallel=True, packing="docs"),
    "pp2_stream": dict(pp=2, packing="stream"),
    # a teacher of another shape (3 layers, a wider MLP: make_bigger_teacher) than the student (2 layers)
    "tp2_big_teacher": dict(tp=2, teacher="big"),
    "pp2_big_teacher": dict(pp=2, teacher="big"),
}
SETTINGS = ("packing", "teacher")  # LAYOUTS' keys that are not parallel settings


def big_teacher(teacher: str) -> str:
    return teacher + "_big"


@torch.no_grad()
def make_bigger_teacher(path: str) -> None:
    """The fixture's Llama with 3 layers and a wider MLP (the student has 2 and 96), and its tokenizer."""
    cfg = hf_config()
    cfg.num_hidden_layers, cfg.intermediate_size = 3, 160
    torch.manual_seed(4)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(path)
    write_char_tokenizer(path)


def layout_config(ckpt: str, teacher: str, data: str, name: str, *, single: bool) -> Config:
    par = dict(LAYOUTS[name])
    if par.pop("teacher", None) == "big":
        teacher = big_teacher(teacher)
    cfg = distill_config(ckpt, teacher, data, micro=1 if par.get("dp") else 2, packing=par.pop("packing", "none"))
    if not single:
        for k, v in par.items():
            setattr(cfg.parallel, k, v)
    return resolve(cfg)


def layouts_rank(rank: int, world: int, ckpt: str, teacher: str, data: str, root: str) -> None:
    for name, par in LAYOUTS.items():
        grid = layout_grid({k: v for k, v in par.items() if k not in SETTINGS})
        run(layout_config(ckpt, teacher, data, name, single=False), grid, os.path.join(root, name))


def policy_config(ckpt: str, teacher: str, data: str, *, lmbda: float = 1.0, seq_kd: bool = False,
                  beta: float = 0.5, sampling_temperature: Optional[float] = None, steps: int = 2, micro: int = 2,
                  seed: int = 0) -> Config:
    """distill_config on generated completions (at temperature 1, GKDTrainer's loss), at most 8 new tokens."""
    cfg = distill_config(ckpt, teacher, data, beta=beta, temperature=1.0, steps=steps, micro=micro)
    d = cfg.distill
    d.lmbda, d.seq_kd, d.max_new_tokens, d.sampling_temperature = lmbda, seq_kd, 8, sampling_temperature
    cfg.train.seed = seed
    return cfg


# name -> parallel settings of the on-policy runs on 2 ranks (each against the single process)
POLICY_LAYOUTS = {"policy_dp2_zero3": dict(dp=2, zero=3), "policy_tp2_sp": dict(tp=2, sequence_parallel=True),
                  "policy_pp2": dict(pp=2), "policy_cp2": dict(cp=2)}
POLICY = dict(lmbda=0.5, seq_kd=True, steps=2)  # train.seed 0 draws the teacher's step, then the student's


def policy_layout_config(ckpt: str, teacher: str, data: str, name: Optional[str]) -> Config:
    """The on-policy run of POLICY at layout `name` (None: the single process)."""
    par = POLICY_LAYOUTS.get(name, {})
    cfg = policy_config(ckpt, teacher, data, micro=1 if par.get("dp") else 2, **POLICY)
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return resolve(cfg)


def policy_layouts_rank(rank: int, world: int, ckpt: str, teacher: str, data: str, root: str) -> None:
    for name, par in POLICY_LAYOUTS.items():
        run(policy_layout_config(ckpt, teacher, data, name), layout_grid(par), os.path.join(root, name))
