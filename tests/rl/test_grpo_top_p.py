"""rl.top_p: the nucleus of rl.prompts' rollouts, as TRL's GRPOTrainer samples (transformers'
TopPLogitsWarper after the temperature).

- megaft's filter equals TopPLogitsWarper on the same logits, ties and min_tokens_to_keep included;
- top_p = 1 is the unfiltered draw bit for bit (every rollout made before rl.top_p existed stays);
- a nucleus narrower than the top token's probability is greedy: an online run's first rollouts
  equal transformers' greedy `generate` of the checkpoint;
- validation refuses a top_p outside (0, 1], or with logged rollouts (nothing is drawn), with the fix.
(tp ranks draw the same tokens at top_p < 1: tests/rl/test_grpo_settings.py and
tests/models/test_generate.py.)
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from models.hf_fixture import load_reference, make_hf_llama
from rl.grpo_cases import G, online_config, run, write_prompts

from megaft.inference.generate import Sampling, draw, draw_generator, top_p_filter
from megaft.parallel.grid import ParallelGrid
from megaft.validation import resolve, validate

EOS = 1  # the fixture tokenizer's <eos>


def _scores() -> torch.Tensor:
    """Rows of random logits, of heavily tied small integers, of all-equal logits and of one
    dominant token: the sort's order among ties decides which tokens survive."""
    torch.manual_seed(0)
    return torch.cat([torch.randn(3, 61) * 3, torch.randint(0, 3, (3, 61)).float(), torch.zeros(1, 61),
                      torch.cat([torch.full((1, 1), 20.0), torch.randn(1, 60)], dim=1)])


@pytest.mark.parametrize("min_keep", [1, 3])
def test_top_p_filter_equals_transformers_with_ties(min_keep):
    scores = _scores()
    for top_p in (1e-6, 0.05, 0.3, 0.5, 0.8, 0.95, 1.0):
        want = transformers.TopPLogitsWarper(top_p, min_tokens_to_keep=min_keep)(None, scores.clone())
        got = top_p_filter(scores, top_p, min_keep)
        assert torch.equal(got, want), (top_p, min_keep)
        kept = (got > float("-inf")).sum(-1)
        assert (kept >= min_keep).all()
        if top_p < 1.0:  # kept: the fewest top tokens reaching top_p (ties at the edge: the sort's choice)
            mass = torch.where(got > float("-inf"), scores.softmax(-1), 0.0).sum(-1)
            assert ((mass >= top_p - 1e-6) | (kept == min_keep)).all()
    assert (top_p_filter(scores, 0.3) == float("-inf")).any()


def test_top_p_one_is_the_unfiltered_draw():
    """rl.top_p = 1 (TRL's default): the same tokens from the same generator as softmax(logits / T)
    drawn directly, so the online rollouts of every earlier run are unchanged."""
    torch.manual_seed(1)
    logits = torch.randn(5, 61) * 2
    sampling = Sampling(temperature=0.7, top_p=1.0, seed=4)
    assert top_p_filter(logits, 1.0) is logits
    g, plain = draw_generator(sampling, 2), draw_generator(sampling, 2)
    for _ in range(30):
        want = torch.multinomial((logits / 0.7).softmax(-1), 1, generator=plain).squeeze(1)
        assert torch.equal(draw(logits, sampling, g), want)


def test_a_tiny_nucleus_is_greedy_generation(tmp_path):
    """rl.top_p=1e-6 keeps one token per draw, the most likely: step 1's G completions of each prompt
    (the checkpoint's weights) are all transformers' greedy continuation, cut after its eos."""
    ckpt, prompts = str(tmp_path / "ckpt"), str(tmp_path / "prompts.jsonl")
    make_hf_llama(ckpt, seed=1)
    write_prompts(prompts)
    cfg = online_config(ckpt, prompts, steps=1)
    cfg.rl.top_p = 1e-6
    run(resolve(cfg), ParallelGrid.single(), str(tmp_path / "run"))
    groups = [json.loads(line) for line in open(tmp_path / "run" / "rollouts.jsonl")]
    ref = load_reference(ckpt)
    assert len(groups) == 2
    for g in groups:
        room = min(8, 16 - len(g["prompt_ids"]))
        out = ref.generate(torch.tensor([g["prompt_ids"]]), max_new_tokens=room, do_sample=False,
                           eos_token_id=EOS, pad_token_id=0)[0, len(g["prompt_ids"]):].tolist()
        want = out[:out.index(EOS) + 1] if EOS in out else out
        assert g["completion_ids"] == [want] * G


def test_validation_refuses_top_p_outside_0_1(tmp_path):
    ckpt, prompts = str(tmp_path / "ckpt"), str(tmp_path / "prompts.jsonl")
    make_hf_llama(ckpt, seed=1)
    write_prompts(prompts)
    for bad in (0.0, 1.5):
        cfg = online_config(ckpt, prompts)
        cfg.rl.top_p = bad
        assert any(f"rl.top_p={bad} must be in (0, 1]" in p and "fix:" in p for p in validate(cfg, 1))
    good = online_config(ckpt, prompts)
    good.rl.top_p = 0.9
    assert validate(good, 1) == []
    logged = online_config(ckpt, None)  # read rollouts are not drawn: a nucleus would be ignored
    logged.rl.prompts, logged.rl.rollouts, logged.rl.top_p = None, prompts, 0.9
    assert any("rl.top_p=0.9 filters the draws of generated rollouts" in p and "fix:" in p
               for p in validate(logged, 1))
