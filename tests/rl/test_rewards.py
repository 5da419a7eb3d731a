"""megaft.rl.rewards: the built-in reward functions, functions named in config (TRL's signature),
their errors, and a GRPO run scored by them instead of the rollouts' own rewards."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from models.hf_fixture import VOCAB, make_hf_llama
from rl.grpo_cases import grpo_config, run, write_rollouts
from train_cases import read_rows

from megaft.parallel.grid import ParallelGrid
from megaft.rl.rewards import RewardError, exact_match, final_answer, load_reward, score
from megaft.validation import resolve, validate


def test_final_answer_and_exact_match():
    assert final_answer("so x = \\boxed{\\frac{1}{3}} done") == "\\frac{1}{3}"
    assert final_answer("work\n#### 42 ") == "42"
    assert final_answer("first\n\nlast line \n") == "last line"
    assert exact_match(["a\n#### 7", "#### 8", "x"], [7, "7", None]) == [1.0, 0.0, None]


def test_format_is_trls_think_format_reward():
    trl_rewards = pytest.importorskip("trl.rewards")
    texts = ["<think>\nreason\n</think>\nanswer", "<think>\nreason\nanswer", "answer <think>x</think>",
             "<think>a</think><think>b</think>"]
    ours = load_reward("format")(completions=texts)
    assert ours == trl_rewards.think_format_reward([[{"content": t}] for t in texts]) and 0 < sum(ours) < len(ours)


def test_functions_named_in_config_and_their_errors(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
        "def picky(completions, **kwargs):\n    return [None if c == 'b' else 1.0 for c in completions]\n"
        "def broken(completions, **kwargs):\n    raise KeyError('answer')\n"
        "def short(completions, **kwargs):\n    return [1.0]\n"
        "def nan(completions, **kwargs):\n    return [float('nan')] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    fns = [(s, load_reward(s)) for s in ("my_rewards:length", "my_rewards:picky")]
    got = score(fns, ["p", "q"], ["abc", "b"], [[1], [2]], {})
    assert got[:, 0].tolist() == [3.0, 1.0] and got[0, 1] == 1.0 and math.isnan(got[1, 1])
    for spec, message in (("no_such_module:fn", r"does not import \(ModuleNotFoundError"),
                          ("my_rewards:missing", r"does not import \(AttributeError"),
                          ("nonsense", "neither a built-in")):
        with pytest.raises(ValueError, match=message):
            load_reward(spec)
    for spec, message in (("my_rewards:broken", "'my_rewards:broken' raised KeyError.*first prompt is 'p'"),
                          ("my_rewards:short", "returned list of 1 values for 2 completions"),
                          ("my_rewards:nan", "returned nan for completion 0")):
        with pytest.raises(RewardError, match=message):
            score([(spec, load_reward(spec))], ["p", "q"], ["a", "b"], [[1], [2]], {})


def test_a_run_scored_by_reward_functions(tmp_path):
    """Rollouts without rewards, each line with an `answer`: rl.reward=[exact_match, format] scores the
    decoded completions (weights 1 and 0.5); the first step's metrics are those of hand-scored rewards."""
    from tokenizers import Tokenizer

    ckpt, logged, unscored = str(tmp_path / "ckpt"), str(tmp_path / "logged.jsonl"), str(tmp_path / "unscored.jsonl")
    make_hf_llama(ckpt, seed=1)
    write_rollouts(logged, VOCAB)
    tok = Tokenizer.from_file(f"{ckpt}/tokenizer.json")
    lines = [json.loads(line) for line in open(logged)]
    with open(unscored, "w") as f:
        for line in lines:
            del line["rewards"]
            line["answer"] = tok.decode(line["completion_ids"][0]).strip()  # the first completion is right
            f.write(json.dumps(line) + "\n")
    cfg = grpo_config(ckpt, unscored, steps=1)
    cfg.rl.reward, cfg.rl.reward_weights = ["exact_match", "format"], [1.0, 0.5]
    assert validate(cfg, 1) == []
    run(resolve(cfg), ParallelGrid.single(), str(tmp_path / "run"))
    first = next(r for r in read_rows(str(tmp_path / "run")) if "loss" in r)
    texts = [[tok.decode(c) for c in line["completion_ids"]] for line in lines[:2]]
    want = torch.tensor([[float(final_answer(t) == line["answer"]) for t in ts]
                         for ts, line in zip(texts, [json.loads(x) for x in open(unscored)][:2])]).reshape(-1)
    assert first["rewards/exact_match/mean"] == pytest.approx(float(want.mean()))
    assert first["rewards/format/mean"] == 0.0 and first["reward"] == pytest.approx(float(want.mean()))
    assert want[0] == 1.0 and want.mean() < 1.0  # the hand count is not all ones
    # the rollouts' own rewards and rl.reward both: refused, naming the line
    both = grpo_config(ckpt, logged)
    both.rl.reward = ["exact_match"]
    assert any(f"{logged}:1: has \"rewards\" and rl.reward scores" in p for p in validate(both, 1))
    bad = grpo_config(ckpt, unscored)
    bad.rl.reward = ["no_such_module:fn"]
    assert any("rl.reward entry 'no_such_module:fn' does not import" in p for p in validate(bad, 1))
