"""train.objective=distill with distill.top_k end to end: the teacher scored once into its top-k per
target token (megaft.distill.stored), training against it with no teacher held.

- k = vocabulary repeats the online teacher's run (loss and grad norm at every step), unpacked and on
  packed documents with the cross-entropy mixed in;
- tp2 (the student's vocabulary split), dp2 ZeRO-3 and tp2 sp on packed documents with k = 8 repeat
  the single process (one spawn);
- distill.scores keeps the scored top-k under its fingerprint, a second run reads it; a stored file of
  other target tokens, k or tokenizer is refused with the fix and left as it was;
- validation refuses top_k < 1 or above the vocabulary, packed streams, pp and cp; the memory
  estimate holds no teacher.
"""
from __future__ import annotations

import os

import pytest
import torch
from models.hf_fixture import VOCAB, make_hf_llama
from multirank import spawn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from train_cases import layout_grid, read_rows, run

from distill.distill_cases import COMPARED, distill_config, write_sft
from megaft.distill.stored import load_topk, save_topk
from megaft.distill.topk import TopK
from megaft.parallel.grid import ParallelGrid
from megaft.perf.memory import estimate_ranks
from megaft.validation import resolve, validate

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)

# name -> parallel settings (and data.packing), every one on 2 ranks in one spawn
LAYOUTS = {"tp2": dict(tp=2), "dp2_zero3": dict(dp=2, zero=3),
           "tp2_sp_docs": dict(tp=2, sequence_parallel=True, packing="docs")}


def _layout_config(ckpt, teacher, data, par, *, single):
    par = dict(par)
    cfg = topk_config(ckpt, teacher, data, 8, micro=1 if par.get("dp") else 2, packing=par.pop("packing", "none"))
    if not single:
        for key, value in par.items():
            setattr(cfg.parallel, key, value)
    return resolve(cfg)


def topk_config(ckpt, teacher, data, k, *, scores=None, micro=2, packing="none"):
    cfg = distill_config(ckpt, teacher, data, micro=micro, packing=packing)
    cfg.distill.top_k, cfg.distill.scores = k, scores
    return cfg


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_topk")
    ckpt, teacher, data = str(root / "student"), str(root / "teacher"), str(root / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_hf_llama(teacher, seed=2)
    write_sft(data)
    return ckpt, teacher, data, root


def _curve(run_dir):
    rows = [r for r in read_rows(run_dir) if "loss" in r]
    assert len(rows) == 2 and len({r["loss"] for r in rows}) == 2 and min(r["loss"] for r in rows) > 0
    return rows


def _close(got, want, what):
    """The same fp32 terms summed in other orders (vocabulary slices, the k ids sorted by the teacher's
    probability, tokens over ranks), through one Adam update: the layout tests' 5e-5 relative."""
    failures = []
    for g, w in zip(got, want):
        for key in COMPARED:
            if abs(g[key] - w[key]) > 5e-5 * max(abs(w[key]), 1e-1):
                failures.append(f"{what} step {w['step']} {key}: {g[key]} against {w[key]}")
    return failures


@pytest.mark.parametrize("packing,alpha", [("none", 0.0), ("docs", 0.3)])
def test_k_vocabulary_repeats_the_online_teacher(inputs, packing, alpha):
    """Rows of unpacked sequences, and of documents packed several to a row (the plan's pieces), with the
    cross-entropy mixed in."""
    ckpt, teacher, data, root = inputs
    online = distill_config(ckpt, teacher, data, packing=packing, alpha=alpha)
    top = topk_config(ckpt, teacher, data, VOCAB, packing=packing)
    top.distill.alpha = alpha
    run(resolve(online), ParallelGrid.single(), str(root / f"online_{packing}"))
    run(resolve(top), ParallelGrid.single(), str(root / f"k_vocab_{packing}"))
    failures = _close(_curve(str(root / f"k_vocab_{packing}")), _curve(str(root / f"online_{packing}")), packing)
    assert not failures, "\n".join(failures)


def _layouts_rank(rank, world, ckpt, teacher, data, root):
    for name, par in LAYOUTS.items():
        grid = layout_grid({k: v for k, v in par.items() if k != "packing"})
        run(_layout_config(ckpt, teacher, data, par, single=False), grid, os.path.join(root, name))


def test_tp2_and_dp2_equal_the_single_process(inputs):
    ckpt, teacher, data, root = inputs
    spawn(2, _layouts_rank, ckpt, teacher, data, str(root / "layouts"))
    failures = []
    for name, par in LAYOUTS.items():
        single = str(root / "single" / name)
        run(_layout_config(ckpt, teacher, data, par, single=True), ParallelGrid.single(), single)
        failures += _close(_curve(str(root / "layouts" / name)), _curve(single), name)
    assert not failures, "\n".join(failures)


def test_scores_are_kept_and_read(inputs):
    ckpt, teacher, data, root = inputs
    scores = str(root / "scores")
    run(resolve(topk_config(ckpt, teacher, data, 8, scores=scores)), ParallelGrid.single(), str(root / "first"))
    (stored,) = os.listdir(scores)
    path = os.path.join(scores, stored)
    # a second run of the same fingerprint reads the file: poisoned log-probs change its loss
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    save_file({**tensors, "logps": tensors["logps"] - 1.0}, path, metadata=meta)
    run(resolve(topk_config(ckpt, teacher, data, 8, scores=scores)), ParallelGrid.single(), str(root / "second"))
    first, second = _curve(str(root / "first")), _curve(str(root / "second"))
    assert abs(first[0]["loss"] - second[0]["loss"]) > 1e-3 * first[0]["loss"]
    assert os.listdir(scores) == [stored]


def test_a_stored_file_of_other_data_is_refused(tmp_path):
    parts = {"n_targets": 5, "top_k": 3, "tokenizer_sha256": "a"}
    top = TopK(torch.zeros(5, 3, dtype=torch.long), torch.full((5, 3), -2.0), torch.full((5,), -1.0))
    path = str(tmp_path / "teacher-topk-x.safetensors")
    save_topk(path, top, parts)
    before = open(path, "rb").read()
    assert torch.equal(load_topk(path, parts).logps, top.logps)
    for other, words in (({"n_targets": 6}, "holds 5 target tokens and this run's data 6"),
                         ({"top_k": 4}, "keeps k=3 ids a token and this run asks distill.top_k=4"),
                         ({"tokenizer_sha256": "b"}, "another tokenizer")):
        with pytest.raises(ValueError, match="fix: move or delete") as err:
            load_topk(path, {**parts, **other})
        assert words in str(err.value), err.value
    assert open(path, "rb").read() == before  # nothing saved is lost
    assert load_topk(str(tmp_path / "none.safetensors"), parts) is None


def test_validation_and_memory(inputs):
    ckpt, teacher, data, _ = inputs
    assert validate(resolve(topk_config(ckpt, teacher, data, 8)), 1) == []
    for k, words in ((0, "distill.top_k=0 must be >= 1"), (VOCAB + 1, f"exceeds the vocabulary ({VOCAB} tokens)")):
        problems = validate(resolve(topk_config(ckpt, teacher, data, k)), 1)
        assert any(words in p for p in problems), problems
    problems = validate(resolve(topk_config(ckpt, teacher, data, 8, packing="stream")), 1)
    assert any("fix: data.packing=docs or none" in p for p in problems), problems
    cfg = topk_config(ckpt, teacher, data, 8)
    cfg.parallel.pp = 2
    problems = validate(resolve(cfg), 2)
    assert any("built for parallel.pp=1 and parallel.cp=1" in p for p in problems), problems
    online = resolve(distill_config(ckpt, teacher, data))
    assert estimate_ranks(online, 1)[0].frozen > 0
    assert estimate_ranks(resolve(topk_config(ckpt, teacher, data, 8)), 1)[0].frozen == 0


def test_megaft_score_stores_what_a_training_run_reads(inputs, tmp_path):
    """megaft-score with distill.scores (megaft-train at train.max_steps=0) writes the top-k file a training
    run of the same fingerprint reads (the run's own scoring would write a second, equal file)."""
    import subprocess
    import sys

    ckpt, teacher, data, _ = inputs
    scores = str(tmp_path / "scores")
    script = "import sys; from megaft.cli import score; sys.argv[0] = 'megaft-score'; sys.exit(score())"
    args = ["device=cpu", "parallel.tp=1", "launcher.nproc=1", f"model.init_from={ckpt}", f"data.path={data}",
            "data.seq_len=16", "data.packing=none",
            "train.objective=distill", f"distill.teacher={teacher}", "distill.top_k=8", "distill.temperature=2.0",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.progress=false",
            f"hydra.run.dir={tmp_path / 'scoring'}", f"distill.scores={scores}"]
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (stored,) = os.listdir(scores)
    before = os.stat(os.path.join(scores, stored)).st_mtime_ns
    run(resolve(topk_config(ckpt, teacher, data, 8, scores=scores)), ParallelGrid.single(), str(tmp_path / "train"))
    assert os.listdir(scores) == [stored] and os.stat(os.path.join(scores, stored)).st_mtime_ns == before
