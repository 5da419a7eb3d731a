"""Configs and rank functions of the preference training tests (tests/pref/test_pref_training.py),
in a module without TRL's imports: the spawned ranks import only this."""
from __future__ import annotations

import json
import os
import random

from train_cases import layout_grid, run  # noqa: F401 (run: the tests import it from here)

from megaft.config import Config
from megaft.validation import resolve

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# what each step's metrics line must repeat of the single process: the loss, the norm and TRL's metrics
COMPARED = ("loss", "grad_norm", "eval_loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected")


def write_pairs(path: str, n: int = 12, seed: int = 0) -> None:
    """`n` text pairs of different lengths (letters only: the fixture's character vocabulary
    has no space), chosen and rejected always different."""
    rng = random.Random(seed)

    def word(lo: int, hi: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for _ in range(n):
            chosen, rejected = word(1, 7), word(1, 7)
            f.write(json.dumps({"prompt": word(2, 6), "chosen": chosen, "rejected": rejected + "q"}) + "\n")


def pref_config(ckpt: str, pairs: str, objective: str = "dpo", steps: int = 3, micro: int = 2) -> Config:
    """A preference run on the tiny checkpoint: 4 pairs a step, constant LR, no weight decay
    (TRL's Trainer exempts other parameters from it than megaft does), seq_len 16."""
    cfg = Config()
    cfg.model.init_from, cfg.data.path, cfg.data.seq_len = ckpt, pairs, 16
    cfg.device = "cpu"
    t = cfg.train
    t.objective, t.max_steps, t.global_batch_size, t.micro_batch_size = objective, steps, 4, micro
    t.progress, t.eval_every, t.tensorboard, t.log_phases = False, 1000, "false", False
    o = cfg.optim
    o.lr = o.min_lr = 1e-2
    o.warmup_steps, o.weight_decay = 0, 0.0
    # Adam divides each gradient element by its own magnitude + eps: at eps 1e-8 an element near zero
    # (a sum of terms that cancel) turns the 1e-10 of rounding a layout's reordered sums leave in it
    # into up to lr/eps = 1e6 times that in its weight (issue 44: 1.4e-4 after one step, on a Mixtral
    # expert). eps 1e-4 bounds that gain by lr/eps = 100; the layouts still differ only by rounding.
    o.eps = 1e-4
    cfg.pref.beta = 0.5
    return cfg


# name -> (objective, parallel settings, LoRA rank), every one on 2 ranks in one spawn
LAYOUTS = {
    "dpo_tp2_sp": ("dpo", dict(tp=2, sequence_parallel=True), 0),
    "dpo_cp2": ("dpo", dict(cp=2), 0),
    "dpo_dp2_zero3": ("dpo", dict(dp=2, zero=3), 0),  # micro 1: each dp rank accumulates 2
    "dpo_lora_tp2": ("dpo", dict(tp=2), 4),
    "orpo_dp2": ("orpo", dict(dp=2, zero=1), 0),
    "orpo_cp2": ("orpo", dict(cp=2), 0),
    "ipo_tp2": ("ipo", dict(tp=2), 0),
    "simpo_dp2": ("simpo", dict(dp=2), 0),
    "dpo_pp2": ("dpo", dict(pp=2), 0),  # 2 micro-batches through the 1f1b schedule
    "orpo_pp2": ("orpo", dict(pp=2), 0),
    # pref.reference: another checkpoint, built at the layout for the scoring pass
    "dpo_ref_pp2": ("dpo", dict(pp=2), 0),
    "dpo_ref_tp2_zero3": ("dpo", dict(tp=2, zero=3), 0),
    # pairs packed (data.packing=docs; pref.share_prompt), against the single process's unpacked rows
    "dpo_packed_tp2_sp": ("dpo", dict(tp=2, sequence_parallel=True), 0),
    "dpo_packed_cp2": ("dpo", dict(cp=2), 0),
    "dpo_shared_dp2_zero1": ("dpo", dict(dp=2, zero=1), 0),
    "orpo_shared_pp2": ("orpo", dict(pp=2), 0),  # micro-batches padded to one shape (rows and length)
    "ipo_shared_tp2": ("ipo", dict(tp=2), 0),
    # pref.reference_mode=online (a reference model kept beside the policy), against the single
    # process's precomputed reference
    "dpo_online_pp2": ("dpo", dict(pp=2), 0),
    "dpo_online_lora_tp2": ("dpo", dict(tp=2), 4),
    "ipo_online_ref_dp2_zero3": ("ipo", dict(dp=2, zero=3), 0),
    # mixtures of experts (the fixture's Mixtral beside the Llama): the router terms over each
    # micro-batch's tokens, the padding left out
    "dpo_moe_ep2": ("dpo", dict(dp=2, ep=2), 0),
    "dpo_moe_tp2_sp": ("dpo", dict(tp=2, sequence_parallel=True), 0),
    "orpo_moe_packed_cp2": ("orpo", dict(cp=2), 0),
    "ipo_moe_pp2": ("ipo", dict(pp=2), 0),
    # shared prompts weigh the router statistics as the unpacked rows hold the prompt: twice
    "dpo_moe_shared_tp2": ("dpo", dict(tp=2), 0),
}
# the packed layouts: name -> pref.share_prompt
PACKED = {"dpo_packed_tp2_sp": False, "dpo_packed_cp2": False, "dpo_shared_dp2_zero1": True,
          "orpo_shared_pp2": True, "ipo_shared_tp2": True, "orpo_moe_packed_cp2": False, "dpo_moe_shared_tp2": True}
ONLINE = ("dpo_online_pp2", "dpo_online_lora_tp2", "ipo_online_ref_dp2_zero3")


def moe_of(ckpt: str) -> str:
    """The Mixtral checkpoint the fixture saves beside `ckpt`."""
    return os.path.join(os.path.dirname(ckpt), "moe")


def reference_of(ckpt: str) -> str:
    """The other checkpoint the fixture saves beside `ckpt` (pref.reference's tests)."""
    return os.path.join(os.path.dirname(ckpt), "ref")


# layouts that also evaluate held-out pairs (data.eval_path: 5 pairs, beside the training file)
EVALUATED = ("dpo_tp2_sp", "dpo_dp2_zero3", "orpo_cp2", "orpo_pp2", "dpo_ref_pp2", "orpo_shared_pp2",
             "dpo_online_pp2")


def eval_pairs_of(pairs: str) -> str:
    return pairs.replace(".jsonl", ".eval.jsonl")


def layout_config(ckpt: str, pairs: str, name: str, *, single: bool) -> Config:
    """The config of LAYOUTS[name], or (`single`) its single-process reference."""
    objective, par, lora = LAYOUTS[name]
    cfg = pref_config(moe_of(ckpt) if "_moe" in name else ckpt, pairs, objective, micro=1 if par.get("dp") else 2)
    if name in EVALUATED:
        cfg.data.eval_path, cfg.train.eval_every = eval_pairs_of(pairs), 2
    if lora:
        cfg.lora.rank, cfg.lora.alpha = lora, 8.0
    if not single:
        for k, v in par.items():
            setattr(cfg.parallel, k, v)
        if name in PACKED:
            cfg.data.packing, cfg.pref.share_prompt = "docs", PACKED[name]
        if name in ONLINE:
            cfg.pref.reference_mode = "online"
    if objective == "simpo":
        cfg.pref.gamma = 0.3
    if "_ref" in name:
        cfg.pref.reference = reference_of(ckpt)
    return resolve(cfg)



def layouts_rank(rank: int, world: int, ckpt: str, pairs: str, root: str) -> None:
    for name, (_, par, _) in LAYOUTS.items():
        cfg = layout_config(ckpt, pairs, name, single=False)
        grid = layout_grid(par)
        run(cfg, grid, os.path.join(root, name))
