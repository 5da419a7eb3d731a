"""A tiny multimodal Gemma 3 checkpoint, an image chat file and the megaft-train config that
trains one on the other, for tests/models/test_vision_train.py (the rank function for the
layouts lives here so that multirank's workers import it by name)."""
from __future__ import annotations

import json
import os

from data.image_fixture import write_images

from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import validate
from models.vlm_fixture import make_processor_gemma3

SEQ_LEN = 64
STEPS = 3
QUESTIONS = [("What is this?", "A red cat."), ("Name it.", "A dog."), ("Color?", "Blue."),
             ("Which one?", "The left."), ("And here?", "Nothing."), ("Say it.", "Yes.")]
TOO_LONG = 2  # conversations whose answer pushes them past SEQ_LEN
# name -> parallel settings of the layouts compared with the single process (2 ranks each)
LAYOUTS = {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sequence_parallel=True), "dp2_zero1": dict(dp=2, zero=1),
           "dp2_zero2": dict(dp=2, zero=2), "dp2_zero3": dict(dp=2, zero=3)}


def write_case(root: str, layers: int = 2) -> tuple[str, str]:
    """(checkpoint dir, data file) under `root`: the checkpoint saved by transformers (`layers` text
    layers), and len(QUESTIONS) conversations with one or two images plus TOO_LONG too long for SEQ_LEN."""
    ckpt = os.path.join(root, "ckpt")
    make_processor_gemma3(ckpt, layers)
    names = list(write_images(os.path.join(root, "img")).values())
    lines = []
    for i, (q, a) in enumerate(QUESTIONS):
        images = [{"type": "image", "image": f"img/{names[(i + k) % len(names)]}"} for k in range(1 + i % 2)]
        lines.append({"messages": [{"role": "user", "content": [*images, {"type": "text", "text": q}]},
                                   {"role": "assistant", "content": a}]})
    for i in range(TOO_LONG):
        lines.insert(2 * i + 1, {"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"img/{names[i]}"},
                                         {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": "A long answer. " * 4}]})
    path = os.path.join(root, "chat.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    write_mixed(root, names)
    return ckpt, path


def write_mixed(root: str, names: list[str]) -> str:
    """A file of two conversations, one with an image and one of text alone: at dp2 with one row
    per rank, one rank runs the tower and the other does not, every step."""
    path = os.path.join(root, "mixed.jsonl")
    lines = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"img/{names[0]}"},
                                                        {"type": "text", "text": "What is this?"}]},
                           {"role": "assistant", "content": "A red cat."}]},
             {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]}]
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return path


def vlm_config(ckpt: str, data: str, world: int = 1, *, micro: int = 2, batch: int = 4, **parallel) -> Config:
    """The run: 3 steps of `batch` conversations in micro-batches of `micro`, validated (and
    resolved) as megaft-train validates it."""
    cfg = Config()
    cfg.device = "cpu"
    cfg.model.init_from, cfg.data.path, cfg.data.packing, cfg.data.seq_len = ckpt, data, "none", SEQ_LEN
    t = cfg.train
    t.max_steps, t.micro_batch_size, t.global_batch_size, t.eval_every, t.progress = STEPS, micro, batch, 100, False
    t.log_phases, t.tensorboard = False, "false"
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 0
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    problems = validate(cfg, world)
    assert not problems, problems
    return cfg


def with_lora(cfg: Config, world: int = 1) -> Config:
    """LoRA on the language model (megaft.peft.vision's recipe), exported as a peft adapter only."""
    cfg.lora.rank, cfg.lora.alpha, cfg.lora.export_merged = 4, 8, False
    cfg.optim.lr = 1e-2  # adapters start at B = 0: a larger step so that 3 steps move the loss
    problems = validate(cfg, world)
    assert not problems, problems
    return cfg


def train(cfg: Config, grid: ParallelGrid, run_dir: str) -> dict:
    os.makedirs(run_dir, exist_ok=True)
    return Trainer(cfg, grid, run_dir).fit()


def train_layouts(rank: int, world: int, root: str, ckpt: str, data: str) -> None:
    """Gemma 3's runs of `train_family_layouts` on this rank."""
    train_family_layouts(vlm_config, world, root, ckpt, data)


def train_family_layouts(config, world: int, root: str, ckpt: str, data: str) -> None:
    """Every LAYOUTS run of a family (`config`: its vlm_config), into root/<name>, then LoRA at tp2
    (root/lora_tp2), dp2 on a file where one rank's row has no image (root/mixed_dp2, ZeRO-1 and 3)
    and that ZeRO-3 run stopped after 2 steps and resumed (root/resumed_dp2_zero3)."""
    for name, par in LAYOUTS.items():
        grid = ParallelGrid.build(tp=par.get("tp", 1), dp=par.get("dp", 1), pp=1, device="cpu")
        train(config(ckpt, data, world, **par), grid, os.path.join(root, name))
    train(with_lora(config(ckpt, data, world, tp=2), world), ParallelGrid.build(tp=2, dp=1, pp=1, device="cpu"),
          os.path.join(root, "lora_tp2"))
    # a step where one dp rank's micro-batch has no image: its tower gets no gradient from it
    for zero, name in [(1, "mixed_dp2"), (3, "mixed_dp2_zero3")]:  # ZeRO-3: that rank runs a blank image
        cfg = config(ckpt, os.path.join(root, "mixed.jsonl"), world, micro=1, batch=2, dp=2, zero=zero)
        train(cfg, ParallelGrid.build(tp=1, dp=2, pp=1, device="cpu"), os.path.join(root, name))
    # the same ZeRO-3 run stopped after 2 steps with a checkpoint, then resumed from it
    for stop_after in (2, None):
        cfg = config(ckpt, os.path.join(root, "mixed.jsonl"), world, micro=1, batch=2, dp=2, zero=3)
        cfg.train.save_every = 1
        run = os.path.join(root, "resumed_dp2_zero3")
        os.makedirs(run, exist_ok=True)
        Trainer(cfg, ParallelGrid.build(tp=1, dp=2, pp=1, device="cpu"), run).fit(stop_after=stop_after)
