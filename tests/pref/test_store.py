"""Preference pairs in the prepared store (megaft.pref.store) and from data.sources.

- megaft-prepare under a preference objective stores every source's pairs with the ids TRL's
  DPOTrainer makes of that file (one file per record form, a Parquet directory among them);
  running it again reuses the store;
- data.sources weights draw pairs per epoch as they draw SFT documents;
- a run on two sources of weight 1 trains exactly as a run on their concatenation;
- a bad pair in a Parquet source is named FILE:ROW before any rank starts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from models.hf_fixture import make_hf_llama
from train_cases import read_rows

from megaft.config.data import DataConfig, SourceConfig
from megaft.data.sources import mixture
from megaft.data.templates import load_chat_template
from megaft.parallel.grid import ParallelGrid
from megaft.pref.batches import PairRows
from megaft.pref.data import Pair, encode_record, parse_pair
from megaft.pref.store import StoredPairs, pair_tokenizer, prepare_pairs
from megaft.validation import resolve, validate
from pref.pref_train_cases import pref_config, run, write_pairs
from tests.data.chat_fixture import hf_tokenizer, make_checkpoint
from tests.pref.test_data import FORMS, THINK, trl_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sources(tmp_path) -> list[str]:
    """One source per record form (TRL decides a file's form from its first row); the
    conversational one as a directory holding a Parquet file."""
    paths = []
    for name, records in FORMS.items():
        if name == "conversational":
            folder = tmp_path / "parquet"
            folder.mkdir()
            # TRL reads conversations as lists of {role, content}: the same columns in every row
            pq.write_table(pa.Table.from_pylist(records), str(folder / "part-0.parquet"))
            paths.append(str(folder))
        else:
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            paths.append(str(path))
    return paths


def test_megaft_prepare_stores_trl_ids_of_every_source(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), THINK)  # its prompts are cut as TRL cuts them
    sources = _sources(tmp_path)
    listed = ", ".join(f"{{path: '{p}', weight: 1}}" for p in sources)
    cmd = [sys.executable, "-m", "megaft.prepare", "train.objective=dpo", f"data.sources=[{listed}]",
           f"model.init_from={ckpt}", f"data.cache_dir={tmp_path / 'cache'}", "data.prepare_workers=2",
           f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180)
    assert out.returncode == 0, out.stderr
    n = sum(len(r) for r in FORMS.values())
    [line] = [x for x in out.stdout.splitlines() if x.startswith("megaft-prepare:")]
    assert line.startswith(f"megaft-prepare: {n} preference pairs")
    path = line.rsplit(" in ", 1)[1]
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["identity"]["kind"] == "pairs" and manifest["counts"]["pairs"] == n
    ptok, template = pair_tokenizer(DataConfig(), init_from=ckpt), load_chat_template("auto", ckpt)
    cut = sum(encode_record(parse_pair(r), ptok.tok, template, ptok.eos_token)[1] for v in FORMS.values() for r in v)
    assert manifest["counts"]["prompts_cut"] == cut > 0  # the THINK template writes prompts alone differently

    data = DataConfig(sources=[SourceConfig(p, 1.0) for p in sources], cache_dir=str(tmp_path / "cache"))
    store = prepare_pairs(data, init_from=ckpt, progress=False)
    assert store.path == path  # the same settings reuse the store
    pairs, hf = StoredPairs(store), hf_tokenizer(ckpt)
    assert list(np.unique(pairs.source, return_counts=True)[1]) == [len(r) for r in FORMS.values()]
    for s, records in enumerate(FORMS.values()):
        got = [pairs[i] for i in np.flatnonzero(pairs.source == s)]
        assert got == [Pair(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trl_dataset(records, hf)]
        assert np.array_equal(pairs.lengths[pairs.source == s], [[len(p.prompt_ids), len(p.chosen_ids),
                                                                  len(p.rejected_ids)] for p in got])


def test_source_weights_draw_pairs_per_epoch(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), THINK)
    sources = _sources(tmp_path)
    weights = [2.0, 0.5, 1.0, 0.0]
    data = DataConfig(sources=[SourceConfig(p, w) for p, w in zip(sources, weights)],
                      cache_dir=str(tmp_path / "cache"), prepare_workers=1)
    table = StoredPairs(prepare_pairs(data, init_from=ckpt, progress=False))
    rows = PairRows(table, 4096, seed=3, pad_id=0, weights=weights)
    for epoch in (0, 1):
        visited = rows.pair_ids(epoch, rows.epoch_size()).numpy()
        assert sorted(visited) == sorted(mixture(table.source, weights, 3, epoch))
        counts = np.bincount(table.source[visited], minlength=4)
        assert list(counts) == [2 * 3, round(0.5 * 2), 3, 0]  # FORMS: 3, 2, 3, 2 pairs


def test_a_run_on_two_sources_equals_a_run_on_their_concatenation(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    make_hf_llama(ckpt, seed=1)
    whole = str(tmp_path / "pairs.jsonl")
    write_pairs(whole)
    lines = open(whole).readlines()
    parts = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    parts[0].write_text("".join(lines[:5]))
    parts[1].write_text("".join(lines[5:]))
    got = {}
    for name in ("path", "sources"):
        cfg = pref_config(ckpt, whole, "dpo", steps=4)
        cfg.data.cache_dir = str(tmp_path / "cache")
        if name == "sources":
            cfg.data.path, cfg.data.sources = None, [SourceConfig(str(p), 1.0) for p in parts]
        cfg = resolve(cfg)
        assert validate(cfg, 1) == []
        run(cfg, ParallelGrid.single(), str(tmp_path / name))
        got[name] = [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s", "time")}
                     for r in read_rows(str(tmp_path / name)) if "loss" in r]
    assert len(got["path"]) == 4 and got["sources"] == got["path"]


def test_a_bad_pair_in_a_parquet_source_is_named_before_any_rank_starts(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    make_hf_llama(ckpt, seed=1)
    good = str(tmp_path / "pairs.jsonl")
    write_pairs(good)
    folder = tmp_path / "more"
    folder.mkdir()
    rows = [{"prompt": "ab", "chosen": "c", "rejected": "d"}, {"prompt": "ab", "chosen": "c", "rejected": "c"}]
    pq.write_table(pa.Table.from_pylist(rows), str(folder / "x.parquet"))
    cfg = pref_config(ckpt, good, "dpo")
    cfg.data.path, cfg.data.sources = None, [SourceConfig(good, 1.0), SourceConfig(str(folder), 1.0)]
    problems = validate(resolve(cfg), 1)
    assert len(problems) == 1 and problems[0].startswith(f"data.sources[1]: {folder / 'x.parquet'}:2: ")
    assert "fix: " in problems[0]


def test_text_answers_end_with_the_tokenizers_eos_as_in_trl(tmp_path):
    """config.json may list another eos first (Llama 3.1: <|end_of_text|>, where the tokenizer's
    eos_token is <|eot_id|>); TRL appends the tokenizer's eos_token, and so does the store."""
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), THINK)
    hf = hf_tokenizer(ckpt)
    other = hf.convert_tokens_to_ids("<|endoftext|>")
    assert other != hf.eos_token_id
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in FORMS["standard"]))
    data = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), prepare_workers=1)
    pairs = StoredPairs(prepare_pairs(data, init_from=ckpt, eos_token_id=[other, hf.eos_token_id], progress=False))
    want = trl_dataset(FORMS["standard"], hf)
    assert [pairs[i] for i in range(len(pairs))] == [Pair(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"])
                                                     for r in want]
    assert all(pairs[i].chosen_ids[-1] == hf.eos_token_id for i in range(len(pairs)))


def test_reference_scores_kept_in_the_pair_store(tmp_path):
    """pref.scores=store: the first run scores into the pair store's scores/ folder, the next run
    of the same fingerprint reads them (no scoring) and trains bitwise alike."""
    import glob

    from megaft.pref.store import pairs_store_path
    from megaft.training.summary import RunSummary

    ckpt = str(tmp_path / "ckpt")
    make_hf_llama(ckpt, seed=1)
    pairs = str(tmp_path / "pairs.jsonl")
    write_pairs(pairs)
    lines = {}
    for name in ("first", "again"):
        cfg = pref_config(ckpt, pairs, "dpo", steps=2)
        cfg.data.cache_dir, cfg.pref.scores = str(tmp_path / "cache"), "store"
        cfg = resolve(cfg)
        assert validate(cfg, 1) == []
        run(cfg, ParallelGrid.single(), str(tmp_path / name))
        lines[name] = [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s", "time")}
                       for r in read_rows(str(tmp_path / name)) if "loss" in r]
        store = pairs_store_path(cfg.data, init_from=ckpt, eos_token_id=cfg.model.extra.get("eos_token_id"))
        assert len(glob.glob(os.path.join(store, "scores", "reference-*.safetensors"))) == 1
    assert RunSummary.read(str(tmp_path / "first")).reference_s > 0
    assert RunSummary.read(str(tmp_path / "again")).reference_s is None
    assert lines["again"] == lines["first"]
