"""A chat fine-tune end to end (issue 12): conversations in a JSONL file, rendered with the
chatml template, trained on the assistant turns only, packed with documents kept apart
(data.packing=docs) from the prepared memory-mapped store. Through megaft-verify's
machinery, at tp=2 with sequence parallel, at pp=2 and at dp=2 with ZeRO-2 the whole run
(loss, grad norm, every step-1 gradient) equals the single process; an interrupted run
resumes to the uninterrupted one's losses bitwise."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from data.chat_fixture import CONVERSATIONS, make_checkpoint
from models.layout_runs import verify  # megaft-verify, its layout on the pooled ranks

from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import validate


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = make_checkpoint(str(root / "tok"))
    path = root / "conversations.jsonl"
    lines = []
    for i in range(48):  # the fixture's conversations, varied so packing has different lengths
        conv = [dict(m) for m in CONVERSATIONS[i % 2]]
        conv[-1]["content"] += " " + "four " * (i % 5)
        lines.append(json.dumps({"messages": conv}))
    path.write_text("\n".join(lines) + "\n")
    return tok, str(path), str(root / "cache")


def chat_config(tok: str, path: str, cache: str, **parallel) -> Config:
    cfg = Config()
    cfg.data.tokenizer, cfg.data.path, cfg.data.cache_dir = tok, path, cache
    cfg.data.chat_template, cfg.data.packing, cfg.data.seq_len = "chatml", "docs", 96
    cfg.model.dim, cfg.model.n_layers, cfg.model.ffn_dim, cfg.model.max_seq_len = 32, 2, 64, 128
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 4
    cfg.launcher.nproc, cfg.verify.steps = 2, 3
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


LAYOUTS = {"tp2_sp": dict(tp=2, dp=1, sequence_parallel=True), "pp2": dict(tp=1, pp=2, dp=1),
           "dp2_zero1": dict(tp=1, dp=2, zero=1), "dp2_zero2": dict(tp=1, dp=2, zero=2),
           "dp2_zero3": dict(tp=1, dp=2, zero=3)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chat_finetune_with_packed_documents_equals_the_single_process(tmp_path, chat_data, layout):
    parallel = LAYOUTS[layout]
    report = verify(chat_config(*chat_data, **parallel), str(tmp_path))
    assert report.passed, report.format()
    summary = json.load(open(os.path.join(tmp_path, "layout", "summary.json")))
    assert summary["packing"] == "docs" and summary["attention"] == "sdpa_mask"
    assert os.listdir(chat_data[2])  # the prepared store was written (and shared by both runs)


def _losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_interrupted_packed_run_resumes_bitwise(tmp_path, chat_data):
    """The packed batch of a step is a pure function of (seed, step): 5 steps, a checkpoint,
    a new Trainer that resumes and 5 more steps (past the end of the first epoch) give the
    straight 10-step run's losses bitwise."""
    cfg = chat_config(*chat_data)
    cfg.launcher.nproc = 1
    cfg.train.max_steps, cfg.train.save_every, cfg.train.eval_every, cfg.train.progress = 10, 5, 100, False
    assert validate(cfg, 1) == []
    straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
    os.makedirs(straight), os.makedirs(interrupted)
    trainer = Trainer(cfg, ParallelGrid.single(), straight)
    assert 4 * 5 < trainer.parts.data.stream.sequences_per_epoch(0) < 4 * 10  # the resumed steps cross an epoch
    trainer.fit()
    Trainer(cfg, ParallelGrid.single(), interrupted).fit(stop_after=5)
    assert sorted(_losses(interrupted)) == list(range(1, 6))
    Trainer(cfg, ParallelGrid.single(), interrupted).fit()
    assert _losses(interrupted) == _losses(straight) and len(_losses(straight)) == 10


def test_interrupted_packed_run_at_dp2_zero3_resumes_bitwise(tmp_path, chat_data):
    """The same under dp=2 with ZeRO-3 (each dp rank's packed rows, sharded parameters and
    moments): step 5's checkpoint, resumed by a new launch of both ranks, gives steps 6-10 of
    the straight run bitwise, across the first epoch's end."""
    from megaft.launch.local import launch_local

    cfg = chat_config(*chat_data, tp=1, dp=2, zero=3)
    t = cfg.train
    t.max_steps, t.save_every, t.eval_every, t.progress, t.tensorboard = 10, 5, 100, False, "false"
    assert validate(cfg, 2) == []
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    launch_local(cfg, str(straight))
    shutil.copytree(straight / "checkpoints" / "step_000005", interrupted / "checkpoints" / "step_000005")
    launch_local(cfg, str(interrupted))
    want = _losses(str(straight))
    assert sorted(want) == list(range(1, 11))
    assert _losses(str(interrupted)) == {step: want[step] for step in range(6, 11)}


@pytest.mark.parametrize("packing", ["docs", "stream"])  # from the prepared store; encoded in memory
def test_conversations_without_an_assistant_turn_are_in_the_summary(tmp_path, chat_data, packing):
    tok, path, _ = chat_data
    lines = open(path).read().splitlines()
    lines[0] = json.dumps({"messages": [m for m in json.loads(lines[0])["messages"] if m["role"] != "assistant"]})
    lines[1] = json.dumps({"messages": [m for m in json.loads(lines[1])["messages"] if m["role"] != "assistant"]})
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    cfg = chat_config(tok, str(tmp_path / "data.jsonl"), str(tmp_path / "cache"))
    cfg.data.packing, cfg.train.max_steps, cfg.launcher.nproc = packing, 1, 1
    assert validate(cfg, 1) == []
    Trainer(cfg, ParallelGrid.single(), str(tmp_path)).fit()
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["conversations_without_assistant"] == 2
