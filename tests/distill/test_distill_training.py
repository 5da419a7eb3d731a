"""train.objective=distill end to end: megaft-train's Trainer with a frozen teacher on SFT data.

- every layout of LAYOUTS (tp2 with sequence parallelism, pp2, dp2 ZeRO-3, cp2 on unpacked rows; tp2 sp
  on documents packed apart, pp2 on a packed stream; tp2 and pp2 with a teacher larger than the
  student) repeats the single process's loss and grad norm at
  every step (one spawn);
- validation refuses a missing teacher, a teacher with another vocabulary or tokenizer, bad
  beta/temperature, each with its fix.
"""
from __future__ import annotations

import json
import os

import pytest
from models.hf_fixture import make_hf_llama
from multirank import spawn
from train_cases import read_rows

from distill.distill_cases import (
    COMPARED,
    LAYOUTS,
    big_teacher,
    distill_config,
    layout_config,
    layouts_rank,
    make_bigger_teacher,
    run,
    write_sft,
)
from megaft.parallel.grid import ParallelGrid
from megaft.validation import resolve, validate


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_train")
    ckpt, teacher, data = str(root / "student"), str(root / "teacher"), str(root / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_hf_llama(teacher, seed=2)
    make_bigger_teacher(big_teacher(teacher))
    write_sft(data)
    return ckpt, teacher, data, root


def test_every_layout_equals_the_single_process(inputs):
    ckpt, teacher, data, root = inputs
    spawn(2, layouts_rank, ckpt, teacher, data, str(root / "layouts"))
    failures = []
    for name in LAYOUTS:
        single = root / "single" / name
        run(layout_config(ckpt, teacher, data, name, single=True), ParallelGrid.single(), str(single))
        want, got = read_rows(str(single)), read_rows(str(root / "layouts" / name))
        losses = [r["loss"] for r in want if "loss" in r]
        assert len(set(losses)) == len(losses) == 2 and min(losses) > 0, name  # the run learns
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            for key in COMPARED:
                if key not in w:
                    continue
                # the layouts reorder fp32 sums (vocabulary slices, tokens over ranks): a few ulps, grown
                # through one Adam update; the pref tests' 5e-5 relative
                if key not in g or abs(g[key] - w[key]) > 5e-5 * max(abs(w[key]), 1e-1):
                    failures.append(f"{name} step {w['step']} {key}: layout {g.get(key)} single {w[key]}")
    assert not failures, "\n".join(failures)


def test_validation_names_the_teachers_problems(inputs, tmp_path):
    ckpt, teacher, data, _ = inputs
    assert validate(resolve(distill_config(ckpt, teacher, data)), 1) == []
    assert validate(resolve(distill_config(ckpt, big_teacher(teacher), data)), 1) == []  # another shape
    missing = validate(resolve(distill_config(ckpt, None, data)), 1)
    assert any("needs distill.teacher" in p for p in missing), missing
    not_hf = validate(resolve(distill_config(ckpt, str(tmp_path), data)), 1)
    assert any("not a Hugging Face checkpoint" in p for p in not_hf), not_hf
    other_vocab = str(tmp_path / "vocab")
    make_hf_llama(other_vocab, seed=3)
    with open(os.path.join(other_vocab, "config.json")) as f:
        raw = json.load(f)
    raw["vocab_size"] += 8
    with open(os.path.join(other_vocab, "config.json"), "w") as f:
        json.dump(raw, f)
    problems = validate(resolve(distill_config(ckpt, other_vocab, data)), 1)
    assert any("vocabulary of" in p and "fix: a teacher of the student's tokenizer" in p for p in problems), problems
    other_tok = str(tmp_path / "tok")
    make_hf_llama(other_tok, seed=3)
    with open(os.path.join(other_tok, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same size, other tokens
    with open(os.path.join(other_tok, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    problems = validate(resolve(distill_config(ckpt, other_tok, data)), 1)
    assert any("maps tokens to other ids" in p for p in problems), problems
    for beta, temperature, words in ((1.0, 1.0, "fix: distill.loss=reverse_kl"), (0.0, 1.0, "loss=forward_kl"),
                                     (0.5, 0.0, "distill.temperature=0.0 must be > 0")):
        problems = validate(resolve(distill_config(ckpt, teacher, data, beta=beta, temperature=temperature)), 1)
        assert any(words in p for p in problems), (beta, temperature, problems)
