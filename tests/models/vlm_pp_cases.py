"""The pipeline runs of tests/models/test_vision_pp.py: a multimodal Gemma 3 and a Qwen2.5-VL
trained at pp2 (the rank function lives here so that multirank's workers import it by name).
The checkpoints, data files and configs are the other VLM train cases'."""
from __future__ import annotations

import os

from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from models.qwen_vl_train_cases import qwen_config
from models.vlm_train_cases import train, vlm_config, with_lora

FAMILIES = {"gemma": vlm_config, "qwen": qwen_config}
PP2 = dict(pp=2)
INTERLEAVED = dict(pp=2, vpp=2, schedule="interleaved")  # 4 virtual stages of one layer (LAYERS = 4)
LAYERS = 4


def pp_grid() -> ParallelGrid:
    return ParallelGrid.build(tp=1, dp=1, pp=2, device="cpu")


def train_pp(rank: int, world: int, root: str, family: str, ckpt: str, data: str) -> None:
    """Into root/<family>_<name>: pp2 1f1b on the chat file (2 micro-batches of 2 rows), pp2 1f1b and
    interleaved (vpp2) on the mixed file (2 micro-batches of one row, one without an image), LoRA at
    pp2, and the mixed run stopped after 2 steps and resumed."""
    config = FAMILIES[family]
    mixed = os.path.join(root, "mixed.jsonl")
    train(config(ckpt, data, world, **PP2), pp_grid(), os.path.join(root, f"{family}_pp2"))
    train(config(ckpt, mixed, world, micro=1, batch=2, **PP2), pp_grid(), os.path.join(root, f"{family}_mixed_pp2"))
    train(config(ckpt, mixed, world, micro=1, batch=2, **INTERLEAVED), pp_grid(),
          os.path.join(root, f"{family}_mixed_interleaved"))
    train(with_lora(config(ckpt, data, world, **PP2), world), pp_grid(), os.path.join(root, f"{family}_lora_pp2"))
    run = os.path.join(root, f"{family}_resumed_pp2")
    os.makedirs(run, exist_ok=True)
    for stop_after in (2, None):
        cfg = config(ckpt, mixed, world, micro=1, batch=2, **PP2)
        cfg.train.save_every = 1
        Trainer(cfg, pp_grid(), run).fit(stop_after=stop_after)


def train_four_ranks(rank: int, world: int, root: str, family: str, ckpt: str, data: str) -> None:
    """On 4 ranks, into root/<family>_<name>: tp2 x pp2 with sequence parallel on the chat file
    (tp2_pp2_sp), and for Qwen2.5-VL pp2 x dp2 ZeRO-3 on the mixed file (mixed_pp2_dp2_zero3), one dp
    rank's row without an image: its first stage runs the tower on a blank image, so both dp ranks
    of the first stage gather the tower's parameters in the same order (Gemma 3 ties its embeddings:
    ZeRO-3 with pp is refused for it)."""
    config = FAMILIES[family]
    cfg = config(ckpt, data, world, tp=2, pp=2, sequence_parallel=True)
    train(cfg, ParallelGrid.build(tp=2, dp=1, pp=2, device="cpu"), os.path.join(root, f"{family}_tp2_pp2_sp"))
    if family == "qwen":
        cfg = config(ckpt, os.path.join(root, "mixed.jsonl"), world, micro=1, batch=2, pp=2, dp=2, zero=3)
        train(cfg, ParallelGrid.build(tp=1, dp=2, pp=2, device="cpu"),
              os.path.join(root, f"{family}_mixed_pp2_dp2_zero3"))
