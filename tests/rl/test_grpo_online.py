"""GRPO on rollouts the policy generates at the training layout (rl.prompts, megaft.rl.online).

- the online run equals, step for step, a run on the rollouts it logged (RUN_DIR/rollouts.jsonl as
  rl.rollouts): generation feeds the same training as a logged file, bit for bit;
- what it generates is what was asked: G completions a prompt, each at most
  rl.max_completion_length tokens, the shorter ones ended by the eos, rewards that vary;
- dp2 with ZeRO-3, tp2 with sequence parallelism, pp2, cp2 (and LoRA at tp2 as LoRA in one process)
  generate the same completions as the single process (each prompt's draws seeded by its step and
  position, whichever prompts share its left-padded batch: the single process pads a step's prompts
  of different lengths together, dp2 decodes each alone) and train the same steps;
- RUN_DIR/samples.jsonl holds each step's first group, decoded, with its rewards;
- a resumed run regenerates the uninterrupted one's rollouts and cuts its log back;
- validation names what online generation needs.
"""
from __future__ import annotations

import json
import os

import pytest
from models.hf_fixture import make_hf_llama
from multirank import spawn
from rl.grpo_cases import ONLINE_LAYOUTS, G, online_config, online_layout_config, online_rank, run, write_prompts
from train_cases import read_rows

from megaft.parallel.grid import ParallelGrid
from megaft.rl.online import Prompt, fit_problems
from megaft.training.loop import Trainer
from megaft.validation import resolve, validate

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)
COMPARED = ("loss", "grad_norm", "reward", "reward_std", "clip_ratio/region_mean")
EOS = 1  # the fixture tokenizer's <eos>


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_online")
    ckpt, prompts = str(root / "ckpt"), str(root / "prompts.jsonl")
    make_hf_llama(ckpt, seed=1)
    write_prompts(prompts)
    run(resolve(online_config(ckpt, prompts)), ParallelGrid.single(), str(root / "single"))
    run(resolve(online_layout_config(ckpt, prompts, "lora", {})), ParallelGrid.single(), str(root / "single_lora"))
    return ckpt, prompts, root


def _lines(run_dir) -> list[dict]:
    return [r for r in read_rows(str(run_dir)) if "loss" in r]


def _groups(run_dir) -> list[dict]:
    with open(f"{run_dir}/rollouts.jsonl") as f:
        return [json.loads(line) for line in f]


def test_generated_groups_are_what_was_asked(inputs):
    _, _, root = inputs
    groups = _groups(root / "single")
    assert len(groups) == 3 * 2  # 3 steps of 2 prompts
    for g in groups:
        assert len(g["completion_ids"]) == G and "answer" in g
        for c in g["completion_ids"]:
            assert 1 <= len(c) <= 8 and len(g["prompt_ids"]) + len(c) <= 16
            assert c[-1] == EOS or len(c) == min(8, 16 - len(g["prompt_ids"]))
            assert EOS not in c[:-1]
    lines = _lines(root / "single")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["reward_std"] > 0 for line in lines)  # the completions differ, and so do their rewards
    assert len({tuple(c) for g in groups for c in g["completion_ids"]}) > 3 * 2 * G // 2


def _samples(run_dir) -> list[dict]:
    with open(f"{run_dir}/samples.jsonl") as f:
        return [json.loads(line) for line in f]


def test_samples_hold_each_steps_first_group_with_its_rewards(inputs):
    """RUN_DIR/samples.jsonl: a line a step (metrics.jsonl's numbers), the step's first prompt and its
    G completions decoded, and `letters`' rewards of them, as the step scored them."""
    from rl.grpo_cases import letters
    from tokenizers import Tokenizer

    ckpt, _, root = inputs
    tok = Tokenizer.from_file(f"{ckpt}/tokenizer.json")
    samples, groups = _samples(root / "single"), _groups(root / "single")
    assert [s["step"] for s in samples] == [1, 2, 3]
    for s, group in zip(samples, groups[::2]):  # 2 groups a step: the first of each
        assert s["prompt"] == tok.decode(group["prompt_ids"], skip_special_tokens=True)
        assert s["completions"] == [tok.decode(c, skip_special_tokens=True) for c in group["completion_ids"]]
        want = letters(completions=s["completions"], answer=[group["answer"]] * G)  # the prompt line's extras
        assert list(s["rewards"]) == ["letters"] and s["rewards"]["letters"] == want and len(want) == G


def test_the_online_run_equals_a_run_on_its_logged_rollouts(inputs, tmp_path):
    ckpt, _, root = inputs
    cfg = online_config(ckpt, None)
    cfg.rl.prompts, cfg.rl.rollouts = None, str(root / "single" / "rollouts.jsonl")
    run(resolve(cfg), ParallelGrid.single(), str(tmp_path / "replay"))
    got, want = _lines(tmp_path / "replay"), _lines(root / "single")
    for a, b in zip(got, want):
        for key in COMPARED:
            assert a[key] == b[key], (a["step"], key)  # one process, the same operations: bit for bit


@pytest.fixture(scope="module")
def layouts(inputs):
    ckpt, prompts, root = inputs
    spawn(2, online_rank, ckpt, prompts, str(root))
    return root


@pytest.mark.parametrize("name", sorted(ONLINE_LAYOUTS))
def test_every_layout_generates_and_trains_as_the_single_process(layouts, name):
    reference = "single_lora" if "lora" in name else "single"
    single = _groups(layouts / reference)
    # the single process decodes each step's 2 prompts as one left-padded batch (lengths 5 and 3, 3 and 4);
    # dp2 decodes each alone, pp2 and tp2 padded as the single process
    assert sum(len(single[2 * s]["prompt_ids"]) != len(single[2 * s + 1]["prompt_ids"]) for s in range(3)) == 2
    assert _groups(layouts / name) == single
    if "lora" in name:  # the adapters trained: steps 2 and 3 generate from other weights than the base's
        assert single != _groups(layouts / "single")
    got, want = _lines(layouts / name), _lines(layouts / reference)
    assert [line["step"] for line in got] == [1, 2, 3]
    for a, b in zip(got, want):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (name, a["step"], key)


def test_a_resumed_run_regenerates_the_uninterrupted_one(inputs, tmp_path):
    ckpt, prompts, root = inputs
    run_dir = str(tmp_path / "resumed")
    first = online_config(ckpt, prompts, steps=3)
    first.train.save_every = 2
    os.makedirs(run_dir)
    Trainer(resolve(first), ParallelGrid.single(), run_dir).fit(stop_after=3)  # logs step 3, keeps step 2's checkpoint
    assert len(_groups(run_dir)) == 3 * 2
    again = online_config(ckpt, prompts, steps=3)
    again.train.save_every = 2
    run(resolve(again), ParallelGrid.single(), run_dir)
    assert _groups(run_dir) == _groups(root / "single")  # step 3's groups cut back, then generated again
    assert _samples(run_dir) == _samples(root / "single")  # and step 3's samples line
    got, want = _lines(run_dir), _lines(root / "single")
    assert got[-1]["step"] == 3
    for key in COMPARED:
        assert got[-1][key] == want[2][key], key


def test_validation_names_what_online_generation_needs(inputs, tmp_path):
    ckpt, prompts, _ = inputs
    assert validate(online_config(ckpt, prompts), 1) == []
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "a" * 20, "answer": "b"}) + "\n")
    cases = [(dict(prompts=str(long)), "prompt 1 has 20 tokens >= data.seq_len=16"),
             (dict(prompts="/no/such.jsonl"), "rl.prompts=/no/such.jsonl is not a file"),
             (dict(reward=[]), "generated completions need reward functions"),
             # the longest prompt is 5 letters (write_prompts): 12 more tokens do not fit in 16
             (dict(max_completion_length=12), "rl.max_completion_length=12 does not fit: prompt"),
             (dict(max_completion_length=12), "fix: rl.max_completion_length=11, or data.seq_len=17, or shorter")]
    for change, message in cases:
        bad = online_config(ckpt, prompts)
        for k, v in change.items():
            setattr(bad.rl, k, v)
        problems = validate(bad, 1)
        assert any(message in p for p in problems), (change, problems)
    fits = online_config(ckpt, prompts)
    fits.rl.max_completion_length = 11  # the fix: 5 + 11 = 16 tokens
    assert validate(fits, 1) == []
    # past the model's positions too: the fix says to raise both
    assert "data.seq_len=17 with model.max_seq_len >= 17 (now 16)" in fit_problems([Prompt([3] * 5, {})], 12, 16, 16)[0]
    cp = online_config(ckpt, prompts)  # the cp ranks of a dp rank generate the same whole sequences
    cp.parallel.cp = 2
    assert validate(cp, 2) == []
