"""A trained reward model as GRPO's reward (`rl.reward=[model:DIR]`): the rewards equal those TRL
1.16's GRPOTrainer computes with that model in `reward_funcs` (its own `_calculate_rewards`), a GRPO
run logs them under the folder's name, and a folder that is not a reward model is refused."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
import transformers
from models.hf_fixture import make_hf_llama
from train_cases import read_rows

from megaft.parallel.grid import ParallelGrid
from megaft.rl.rewards import load_reward, reward_name
from megaft.validation import resolve, validate
from reward.reward_cases import make_hf_reward

G = 4
PROMPTS = ["abc", "Hello", "xyzw"]
COMPLETIONS = ["def", "q", "ZZZZz", "ab", "World", "W", "o", "p", "aa", "bbbbbb", "c", "Q"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_reward")
    make_hf_llama(str(root / "lm"), seed=1)
    make_hf_reward(str(root / "rm"), str(root / "lm"), seed=3)
    return str(root / "lm"), str(root / "rm"), root


def test_rewards_equal_trls_model_reward(models, tmp_path):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    lm, rm, _ = models

    def tok(path):
        return PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"), pad_token="<pad>",
                                       eos_token="<eos>", unk_token="<unk>")
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=G, num_generations=G,
                      max_completion_length=8, report_to=[], use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=lm, reward_funcs=[reward], reward_processing_classes=[tok(rm)], args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok(lm))
    prompts = [p for p in PROMPTS for _ in range(G)]
    want = trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, COMPLETIONS,
                                      [[0]] * len(COMPLETIONS))[:, 0]
    fn = load_reward(f"model:{rm}")
    got = torch.tensor(fn(prompts=prompts, completions=COMPLETIONS, completion_ids=[[0]] * len(COMPLETIONS)))
    assert want.std() > 0  # the texts get different rewards
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)  # fp32, other batch shapes
    assert reward_name(f"model:{rm}") == "rm" and trainer.reward_func_names == ["rm"]


def test_a_grpo_run_logs_the_models_rewards(models, tmp_path):
    from rl.grpo_cases import grpo_config
    from tokenizers import Tokenizer

    from megaft.reward.model import _load, score_texts
    from megaft.training.loop import Trainer

    lm, rm, _ = models
    rng = random.Random(0)
    rollouts = tmp_path / "rollouts.jsonl"
    with open(rollouts, "w") as f:
        for _ in range(2):
            f.write(json.dumps({"prompt_ids": [rng.randrange(3, 61) for _ in range(3)],
                                "completion_ids": [[rng.randrange(3, 61) for _ in range(rng.randint(1, 6))]
                                                   for _ in range(G)]}) + "\n")
    cfg = grpo_config(lm, str(rollouts), steps=1)
    cfg.rl.reward = [f"model:{rm}"]
    cfg = resolve(cfg)
    assert not validate(cfg, 1)
    os.makedirs(tmp_path / "run")
    Trainer(cfg, ParallelGrid.single(), str(tmp_path / "run")).fit()
    line = next(r for r in read_rows(str(tmp_path / "run")) if "loss" in r)
    policy = Tokenizer.from_file(os.path.join(lm, "tokenizer.json"))
    texts = []
    for rec in map(json.loads, open(rollouts)):
        prompt = policy.decode(rec["prompt_ids"], skip_special_tokens=True)
        texts += [prompt + policy.decode(c, skip_special_tokens=True) for c in rec["completion_ids"]]
    held = _load(rm)
    want = torch.tensor(score_texts(held["model"], held["tok"], texts))
    assert abs(line["rewards/rm/mean"] - want.mean().item()) < 1e-5


def test_a_folder_that_is_not_a_reward_model_is_refused(models, tmp_path):
    lm, _, _ = models
    with pytest.raises(ValueError, match="names no \\*ForSequenceClassification with one label"):
        load_reward(f"model:{lm}")
    with pytest.raises(ValueError, match="has no config.json and tokenizer.json; fix: the RUN_DIR/hf export"):
        load_reward(f"model:{tmp_path}")


def test_online_generation_is_scored_by_the_model(models, tmp_path):
    """rl.prompts (the policy generating at the training layout): each step's completions are scored by
    the reward model as they are generated (rewards/<name>/mean of the logged rollouts' texts)."""
    from rl.grpo_cases import online_config, write_prompts
    from tokenizers import Tokenizer

    from megaft.reward.model import _load, score_texts
    from megaft.training.loop import Trainer

    lm, rm, _ = models
    prompts = str(tmp_path / "prompts.jsonl")
    write_prompts(prompts)
    cfg = online_config(lm, prompts, steps=1)
    cfg.rl.reward = [f"model:{rm}"]
    cfg = resolve(cfg)
    assert not validate(cfg, 1)
    os.makedirs(tmp_path / "run")
    Trainer(cfg, ParallelGrid.single(), str(tmp_path / "run")).fit()
    line = next(r for r in read_rows(str(tmp_path / "run")) if "loss" in r)
    policy = Tokenizer.from_file(os.path.join(lm, "tokenizer.json"))
    texts = []
    for rec in map(json.loads, open(tmp_path / "run" / "rollouts.jsonl")):
        prompt = policy.decode(rec["prompt_ids"], skip_special_tokens=True)
        texts += [prompt + policy.decode(c, skip_special_tokens=True) for c in rec["completion_ids"]]
    assert len(texts) == 2 * G  # step 1's two groups
    held = _load(rm)
    want = torch.tensor(score_texts(held["model"], held["tok"], texts))
    assert want.std() > 0 and abs(line["rewards/rm/mean"] - want.mean().item()) < 1e-5
