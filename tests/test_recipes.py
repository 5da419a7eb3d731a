"""The recipes (conf/recipe/) and the learning-rate defaults a fine-tuner expects (issue 45).

- every recipe composes and validates on a published config.json of the test corpus
  (tests/models/real_configs/: Llama-3.2-1B-Instruct's, alone in a folder with an empty weights
  file: validation reads config.json only), and the command line still wins over it;
- every value a fine-tuning recipe sets cites a source defined, with its address, in the file;
- `optim.lr=5e-5` alone is accepted (the floor follows lr: optim.min_lr_ratio), an explicit
  optim.min_lr wins, optim.warmup_ratio becomes ceil(ratio * max_steps) steps, and setting both
  warmups is refused;
- a run that loads pretrained weights at the demo's learning rate warns once, naming the
  recipes; a recipe's run does not.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil

import pytest
from data.chat_fixture import CHATML_PLAIN, make_checkpoint
from omegaconf import OmegaConf

from megaft.config import compose_config, conf_dir
from megaft.config.optim import OptimConfig, check_optim
from megaft.optim.schedule import lr_at
from megaft.train import prepare_run
from megaft.validation import validate

RECIPES = ("demo", "dpo_lora", "grpo", "sft_full", "sft_lora")
PUBLISHED = os.path.join(os.path.dirname(__file__), "models", "real_configs", "llama-3.2-1b-instruct.json")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A folder with Llama-3.2-1B-Instruct's published config.json (and an empty weights file), a
    ChatML tokenizer, a chat file and a pairs file."""
    root = tmp_path_factory.mktemp("recipes")
    ckpt = root / "llama"
    ckpt.mkdir()
    shutil.copy(PUBLISHED, ckpt / "config.json")
    (ckpt / "model.safetensors").write_bytes(b"")
    make_checkpoint(str(root / "tok"), chat_template=CHATML_PLAIN)
    turns = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is four."}]
    (root / "chat.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    (root / "pairs.jsonl").write_text(json.dumps({"prompt": "two plus two?", "chosen": "four", "rejected": "five"})
                                      + "\n")
    with open(root / "rollouts.jsonl", "w") as f:  # 8 prompts of 8 completions: the recipe's 64 a step
        for p in range(8):
            f.write(json.dumps({"prompt_ids": [100 + p, 7, 9], "completion_ids": [[200 + g, 13] for g in range(8)],
                                "rewards": [float(g % 2) for g in range(8)]}) + "\n")
    return root


def overrides(files, recipe: str) -> list[str]:
    if recipe == "grpo":  # logged rollouts: token ids, no data file
        return [f"model.init_from={files / 'llama'}", "recipe=grpo", f"rl.rollouts={files / 'rollouts.jsonl'}",
                f"data.tokenizer={files / 'tok'}", f"data.cache_dir={files / 'prepared'}"]
    data = ["data=jsonl", f"data.path={files / 'pairs.jsonl'}"] if recipe == "dpo_lora" else \
        ["data=chat", f"data.path={files / 'chat.jsonl'}"]
    return [f"model.init_from={files / 'llama'}", f"recipe={recipe}", *data, f"data.tokenizer={files / 'tok'}",
            f"data.cache_dir={files / 'prepared'}"]


def test_the_recipe_group_holds_the_recipes():
    assert sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir(), "recipe"))) == sorted(RECIPES)
    assert compose_config([]).train.max_steps == 250  # recipe=demo is the default: the demo as it was


@pytest.mark.parametrize("recipe", RECIPES[1:])
def test_each_recipe_validates_on_a_published_config(files, recipe):
    cfg = compose_config(overrides(files, recipe))
    raw = OmegaConf.load(os.path.join(conf_dir(), "recipe", f"{recipe}.yaml"))
    lora = raw.lora.rank if "lora" in raw else 0
    assert (cfg.optim.lr, cfg.train.epochs, cfg.lora.rank) == (raw.optim.lr, raw.train.epochs, lora)
    assert cfg.train.max_steps is None and cfg.optim.warmup_steps is None
    assert validate(cfg, 2) == []
    assert (cfg.model.n_layers, cfg.model.n_heads, cfg.model.kv_heads) == (16, 32, 8)  # resolved from the file


def test_the_command_line_wins_over_the_recipe(files):
    cfg = compose_config(overrides(files, "sft_lora") + ["optim.lr=1e-4", "train.epochs=2.5", "lora.rank=4"])
    assert (cfg.optim.lr, cfg.train.epochs, cfg.lora.rank, cfg.lora.alpha) == (1e-4, 2.5, 4, 16)
    steps = compose_config(overrides(files, "sft_lora") + ["train.max_steps=5"])
    assert any("train.max_steps=5 and train.epochs=1.0 are both set" in p and "train.epochs=null" in p
               for p in validate(steps, 2))
    steps = compose_config(overrides(files, "sft_lora") + ["train.max_steps=5", "train.epochs=null"])
    assert validate(steps, 2) == [] and steps.train.max_steps == 5


@pytest.mark.parametrize("recipe", RECIPES[1:])
def test_every_recipe_value_cites_a_defined_source(recipe):
    with open(os.path.join(conf_dir(), "recipe", f"{recipe}.yaml")) as f:
        lines = f.read().splitlines()
    defined, tag = set(), None  # a source: "#   [X] what" in the header, its address on that line or the next ones
    for line in (line for line in lines if line.startswith("#")):
        opens = re.match(r"#\s+\[(\w+)\]", line)
        tag = opens.group(1) if opens else tag
        if "https://" in line and tag:
            defined.add(tag)
    assert len(defined) >= 2, lines
    for line in lines:
        value = re.match(r"\s+\w+: (?!null)[^#]+#(.*)", line)
        if line.startswith(" ") and ": null" not in line:
            assert value is not None, f"{recipe}: no comment on {line!r}"
            cited = set(re.findall(r"\[(\w+)\]", value.group(1)))
            assert cited and cited <= defined, f"{recipe}: {line!r} cites {cited}, the file defines {defined}"


def test_lowering_lr_alone_is_accepted_and_the_floor_follows():
    cfg = compose_config(["optim.lr=5e-5"])
    assert validate(cfg, 2) == []
    o = cfg.optim
    assert lr_at(cfg.train.max_steps, o, cfg.train.max_steps) == 5e-5 * 0.1  # the end of the cosine: the floor
    o.min_lr = 1e-6  # an absolute floor wins over the ratio
    assert lr_at(cfg.train.max_steps, o, cfg.train.max_steps) == 1e-6
    o.min_lr = 1e-4  # above lr: refused, naming the fix
    assert check_optim(o) == ["optim.lr=5e-05, optim.min_lr=0.0001: need 0 <= min_lr <= lr; fix: optim.min_lr=null "
                              "(the floor is then optim.min_lr_ratio * lr = 0.1 * lr) or a min_lr below lr"]


def test_warmup_ratio_is_a_fraction_of_the_steps_and_not_beside_warmup_steps():
    o = OptimConfig(lr=1.0, warmup_steps=None, warmup_ratio=0.03, min_lr_ratio=0.0)
    warm = math.ceil(0.03 * 250)  # 8: transformers' get_warmup_steps rounds up
    assert [lr_at(s, o, 250) for s in (0, warm - 1)] == [1 / warm, 1.0]
    assert lr_at(warm, o, 250) == 1.0 and lr_at(250, o, 250) == 0.0
    assert lr_at(0, OptimConfig(lr=1.0, warmup_steps=None), 250) == 1.0  # neither: no warmup
    both = check_optim(OptimConfig(warmup_steps=20, warmup_ratio=0.1))
    assert len(both) == 1 and "both set" in both[0] and "optim.warmup_steps=null" in both[0]
    assert check_optim(OptimConfig(warmup_steps=None, warmup_ratio=1.5)) == [
        "optim.warmup_ratio=1.5 must be in [0, 1] (a fraction of train.max_steps); fix: e.g. 0.03"]


def test_pretrained_weights_at_the_demo_lr_warn_once_naming_the_recipes(files, tmp_path, caplog):
    demo = compose_config([f"model.init_from={files / 'llama'}", "data=chat", f"data.path={files / 'chat.jsonl'}",
                           f"data.tokenizer={files / 'tok'}", f"data.cache_dir={files / 'prepared'}"])
    with caplog.at_level(logging.WARNING, logger="megaft"):
        prepare_run(demo, str(tmp_path / "demo"), 2)
    warned = [r.getMessage() for r in caplog.records if "demo's learning rate" in r.getMessage()]
    assert len(warned) == 1 and "recipe=dpo_lora | grpo | sft_full | sft_lora" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaft"):
        prepare_run(compose_config(overrides(files, "sft_lora")), str(tmp_path / "lora"), 2)
        prepare_run(compose_config(["optim.lr=3e-3"]), str(tmp_path / "scratch"), 2)  # the demo itself
    assert not [r for r in caplog.records if "demo's learning rate" in r.getMessage()]
