"""A chat fine-tune end to end (issue 12): conversations in a JSONL file, rendered with the
chatml template, trained on the assistant turns only, packed with documents kept apart
(data.packing=docs) from the prepared memory-mapped store. Through megaft-verify's
machinery, at tp=2 with sequence parallel and at pp=2 the whole run (loss, grad norm,
every step-1 gradient) equals the single process."""
from __future__ import annotations

import json
import os

import pytest
from data.chat_fixture import CONVERSATIONS, make_checkpoint

from megaft.config import Config
from megaft.verify.run import run_verify


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


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_chat_finetune_with_packed_documents_equals_the_single_process(tmp_path, chat_data, layout):
    parallel = dict(tp=2, dp=1, sequence_parallel=True) if layout == "tp2_sp" else dict(tp=1, pp=2, dp=1)
    report = run_verify(chat_config(*chat_data, **parallel), str(tmp_path))
    assert report.passed, report.format()
    summary = json.load(open(os.path.join(tmp_path, "layout", "summary.json")))
    assert summary["packing"] == "docs" and summary["attention"] == "sdpa_mask"
    assert os.listdir(chat_data[2])  # the prepared store was written (and shared by both runs)
