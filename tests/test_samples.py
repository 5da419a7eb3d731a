"""Samples while training (train.sample_every, sample.*; megaft.training.samples): the run
writes samples.jsonl at the expected steps without changing the training; the prompt file
and the settings are validated before any rank starts."""
from __future__ import annotations

import json
import os

import pytest
from train_cases import read_metrics, small_config

from megaft.config.parallel import resolve_dp
from megaft.config.train import SampleConfig, use_tensorboard
from megaft.data.prompts import check_samples
from megaft.data.templates import load_chat_template
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.training.samples import opening
from megaft.validation import check_fixed_settings, check_settings


def _prompts(tmp_path, lines: list[str]) -> str:
    path = os.path.join(str(tmp_path), "prompts.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _run(run_dir: str, prompts=None, **sample) -> Trainer:
    cfg = small_config(steps=5)
    cfg.train.eval_every, cfg.train.tensorboard = 100, "auto"
    if prompts is not None:
        cfg.train.sample_every = 2
        cfg.sample.prompts = prompts
        for key, value in sample.items():
            setattr(cfg.sample, key, value)
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, ParallelGrid.single(), run_dir)
    trainer.fit()
    return trainer


def test_a_run_writes_samples_at_the_expected_steps_and_trains_the_same(tmp_path):
    prompts = _prompts(tmp_path, ['{"prompt": "abc"}', '{"prompt": "hello"}'])
    _run(str(tmp_path / "plain"))
    trainer = _run(str(tmp_path / "sampled"), prompts, temperature=0.8, top_p=0.9, seed=1, max_new_tokens=6)
    with open(tmp_path / "sampled" / "samples.jsonl") as f:
        lines = [json.loads(line) for line in f]
    # step 0 (before any update), every 2 steps, and the last step (5)
    assert [(line["step"], line["prompt"]) for line in lines] == [
        (s, p) for s in (0, 2, 4, 5) for p in ("abc", "hello")]
    assert all(isinstance(line["text"], str) for line in lines)
    assert any(line["text"] for line in lines)
    # generation leaves the training alone: the same loss curve as without samples
    assert read_metrics(str(tmp_path / "sampled"))[0] == read_metrics(str(tmp_path / "plain"))[0]
    # the draws are seeded by (sample.seed, step): the same step draws the same again
    again = trainer.sampler.run(trainer.parts.step.generator, 5, device=trainer.grid.device,
                                autocast=trainer.parts.step.autocast)
    assert again == lines[-2:]
    if use_tensorboard("auto"):  # the same texts in TensorBoard, tag samples/<prompt index>
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "sampled" / "tensorboard"))
        events.Reload()
        texts = events.Tensors("samples/1/text_summary")
        assert [t.step for t in texts] == [0, 2, 4, 5]
        assert texts[-1].tensor_proto.string_val[0].decode() == f"hello\n\n→ {lines[-1]['text']}"


def test_postfix_shows_the_first_samples_opening_words():
    assert opening("one two three four five six seven eight") == "one two three four five six"
    assert Trainer._postfix(None, {}, "the cat")["sample"] == "the cat"
    assert "sample" not in Trainer._postfix(None, {})


def test_validation_reports_every_problem_with_its_fix(tmp_path):
    cfg = small_config(steps=5)
    cfg.train.sample_every = 10
    problems = check_fixed_settings(cfg)
    assert any("train.sample_every=10 needs prompts" in p and "sample.prompts=FILE" in p for p in problems)

    cfg.sample.prompts = str(tmp_path / "missing.jsonl")
    assert any("is not a file" in p for p in check_fixed_settings(cfg))

    bad = _prompts(tmp_path, ['{"prompt": "fine"}', '{"prompt": "x"', '{"text": "no"}'])
    cfg.sample.prompts = bad
    problems = check_fixed_settings(cfg)
    assert any(p.startswith(f"{bad}:2: not JSON") and "fix:" in p for p in problems), problems

    cfg.sample = SampleConfig(prompts=_prompts(tmp_path, ['{"text": "no"}']), temperature=-1, top_p=0,
                              max_new_tokens=0)
    cfg.train.sample_every = -1
    problems = check_settings(cfg, 1)
    for expected in (f"{cfg.sample.prompts}:1: a line must be", "sample.temperature=-1", "sample.top_p=0",
                     "sample.max_new_tokens=0", "train.sample_every=-1"):
        assert any(expected in p for p in problems), (expected, problems)


def test_conversations_need_a_chat_template(tmp_path):
    chat = _prompts(tmp_path, ['{"messages": [{"role": "user", "content": "hi"}]}'])
    problems = check_samples(SampleConfig(prompts=chat), 5, lambda: None)
    assert len(problems) == 1 and "no chat template" in problems[0]
    assert check_samples(SampleConfig(prompts=chat), 5, lambda: load_chat_template("chatml", None)) == []


@pytest.mark.parametrize("line", ['{"prompt": 3}', '{"messages": []}', '{"prompt": "a", "messages": []}', "[]"])
def test_bad_prompt_lines(tmp_path, line):
    problems = check_samples(SampleConfig(prompts=_prompts(tmp_path, [line])), 1, lambda: None)
    assert len(problems) == 1 and ":1: a line must be" in problems[0]


# tp and sequence parallel: tests/models/test_generate.py
LAYOUTS = [("zero3", dict(tp=1, zero=3)), ("pp2", dict(tp=1, pp=2))]


def _layout_config(prompts: str, **parallel):
    cfg = small_config(steps=2, micro=4)
    cfg.train.eval_every, cfg.train.sample_every = 100, 2
    cfg.sample.prompts, cfg.sample.max_new_tokens = prompts, 8
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _layout_runs(rank: int, world: int, root: str, prompts: str) -> None:
    for name, parallel in LAYOUTS:
        cfg = _layout_config(prompts, **parallel)
        par = cfg.parallel
        grid = ParallelGrid.build(tp=par.tp, dp=resolve_dp(par, world), pp=par.pp, device="cpu")
        os.makedirs(os.path.join(root, name), exist_ok=True)
        Trainer(cfg, grid, os.path.join(root, name)).fit()


def test_samples_at_the_training_layouts_equal_one_process(tmp_path):
    """Greedy samples written under dp=2 with ZeRO-3 (whole layers gathered) and pp=2 equal the
    single process's (the models agree to rounding)."""
    from multirank import spawn

    prompts = _prompts(tmp_path, ['{"prompt": "abcde"}', '{"prompt": "xyz"}'])
    single = _layout_config(prompts, tp=1)
    os.makedirs(tmp_path / "single")
    Trainer(single, ParallelGrid.single(), str(tmp_path / "single")).fit()
    spawn(2, _layout_runs, str(tmp_path), prompts)

    def read(name):
        with open(tmp_path / name / "samples.jsonl") as f:
            return [json.loads(line) for line in f]

    want = read("single")
    assert [line["step"] for line in want] == [0, 0, 2, 2] and all(line["text"] for line in want)
    for name, _ in LAYOUTS:
        assert read(name) == want, name
