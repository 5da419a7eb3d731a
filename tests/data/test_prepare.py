"""The prepared dataset: equal to in-memory encoding, cached by content, crash-safe, locked."""
import hashlib
import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

import megaft.data.prepare as prep
from megaft.config.data import DataConfig, SourceConfig
from megaft.data.build import chat_encoder, load_examples
from megaft.data.encode import encode_examples
from megaft.data.errors import DataError
from megaft.data.packed import EncodedCorpus, PackedDocs
from megaft.data.prepare import prepare_dataset, prepared_path
from megaft.data.store import PreparedDataset, is_complete
from tests.data.chat_fixture import CHATML_PLAIN, CONVERSATIONS, make_checkpoint

RECORDS = [{"text": "two plus two"}, {"prompt": "The capital of", "completion": " France"},
           {"messages": CONVERSATIONS[0]}, {"conversations": [{"from": "system", "value": "You are Qwen"},
                                                             {"from": "human", "value": "two?"},
                                                             {"from": "gpt", "value": "four"}]},
           {"messages": CONVERSATIONS[1]}, {"messages": CONVERSATIONS[2]}]


def write_jsonl(path, records, blank_every=0):
    with open(path, "w") as f:
        for i, r in enumerate(records):
            f.write(json.dumps(r) + "\n")
            if blank_every and i % blank_every == 0:
                f.write("\n")
    return str(path)


@pytest.fixture
def setup(tmp_path):
    """A checkpoint with a ChatML template, a JSONL file, a directory with JSONL + Parquet."""
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), CHATML_PLAIN)
    a = write_jsonl(tmp_path / "a.jsonl", RECORDS * 50, blank_every=7)  # 300 records: 2 chunks
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "sub" / "b.jsonl", RECORDS[::-1])
    # Parquet holds ShareGPT/messages rows as nested columns: one table per form.
    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS]), str(d / "c.parquet"))
    cfg = DataConfig(sources=[SourceConfig(a, 1.0), SourceConfig(str(d), 2.0)], cache_dir=str(tmp_path / "cache"),
                     prepare_workers=1, seq_len=32)
    return cfg, ckpt, tmp_path


def in_memory(cfg, ckpt):
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    examples = []
    for s in cfg.sources:
        examples += load_examples(DataConfig(path=s.path)).train
    eos = tok.token_to_id("<|im_end|>")
    return encode_examples(tok, examples, eos, chat=chat_encoder(cfg, tok, init_from=ckpt))


@pytest.mark.parametrize("workers", [1, 2])
def test_memory_mapped_store_equals_in_memory_encoding(setup, workers):
    cfg, ckpt, _ = setup
    cfg.prepare_workers = workers
    ds = prepare_dataset(cfg, init_from=ckpt, eos_token_id=2, progress=False)  # 2 = <|im_end|>
    want = in_memory(cfg, ckpt)
    assert len(ds) == len(want) == 300 + 6 + 3
    assert [ds.encoded(i) for i in range(len(ds))] == want
    assert isinstance(ds.tokens, np.memmap) and isinstance(ds.offsets, np.memmap)
    assert ds.source.tolist() == [0] * 300 + [1] * 9
    m = ds.manifest
    assert m["counts"]["documents"] == 309 and m["counts"]["tokens"] == sum(len(e.ids) for e in want)
    assert m["counts"]["targets"] == sum(sum(e.target) for e in want)
    assert m["counts"]["documents_without_targets"] == sum(not any(e.target) for e in want)
    files = {f["path"]: f for f in m["files"]}
    a = cfg.sources[0].path
    assert files[a]["sha256"] == hashlib.sha256(open(a, "rb").read()).hexdigest()
    assert files[a]["records"] == 300 and files[a]["size"] == os.path.getsize(a)
    assert m["template"]["name"].endswith("tokenizer_config.json") and m["options"]["train_on"] == "assistant"
    assert sorted(os.listdir(ds.path)) == ["manifest.json", "offsets.npy", "prompt_len.npy", "source.npy",
                                           "target.bin", "tokens.bin", "verified.json"]
    # each array's size and sha256, as written
    assert {k: v["bytes"] for k, v in m["arrays"].items()} == {
        name: os.path.getsize(os.path.join(ds.path, name)) for name in m["arrays"]}
    assert m["arrays"]["tokens.bin"]["sha256"] == hashlib.sha256(open(os.path.join(ds.path, "tokens.bin"), "rb")
                                                                  .read()).hexdigest()
    assert m["max_token_id"] == max(max(e.ids) for e in want)
    # Weights are applied when reading (the mixture), so the same cache serves any weights.
    assert len(ds.to_encoded([s.weight for s in cfg.sources])) == 300 + 2 * 9
    # Packing the mapped store gives the batches of packing the in-memory encoding.
    corpus = EncodedCorpus(want)
    corpus.source = np.array(ds.source)
    with pytest.warns(UserWarning, match="longer than seq_len"):
        mapped = PackedDocs(ds, 32, seed=1, weights=[1, 2], pad_id=0)
        memory = PackedDocs(corpus, 32, seed=1, weights=[1, 2], pad_id=0)
    for step in (0, 5, 40):
        assert all(torch.equal(a, b) for a, b in zip(mapped.doc_batch(step, 4), memory.doc_batch(step, 4)))


def test_ready_cache_is_reused_and_a_changed_input_is_a_new_cache(setup, monkeypatch):
    cfg, ckpt, tmp_path = setup
    first = prepare_dataset(cfg, init_from=ckpt, progress=False).path
    assert prepared_path(cfg, init_from=ckpt) == first

    def no_build(*args):
        raise AssertionError("rebuilt a ready cache")

    monkeypatch.setattr(prep, "_build", no_build)
    cfg.sources[1].weight = 5.0  # reweighting reuses the cache
    assert prepare_dataset(cfg, init_from=ckpt, progress=False).path == first
    monkeypatch.undo()
    # A changed source (one more line): a new directory with the new data; the old one stays.
    with open(cfg.sources[0].path, "a") as f:
        f.write(json.dumps({"text": "four"}) + "\n")
    changed = prepare_dataset(cfg, init_from=ckpt, progress=False)
    assert changed.path != first and len(changed) == 310 and is_complete(first)
    # Same size, same mtime, other bytes: the sampled hash still tells.
    src = cfg.sources[0].path
    st = os.stat(src)
    text = open(src).read().replace('"four"}', '"fout"}')
    open(src, "w").write(text)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prepared_path(cfg, init_from=ckpt) not in (first, changed.path)
    # Another tokenizer, template or train_on: new caches too.
    paths = {prepared_path(cfg, init_from=ckpt)}
    cfg.train_on = "all"
    paths.add(prepared_path(cfg, init_from=ckpt))
    cfg.chat_template = "chatml"
    paths.add(prepared_path(cfg, init_from=ckpt))
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    tok.add_tokens(["<extra>"])
    tok.save(os.path.join(ckpt, "tokenizer.json"))
    paths.add(prepared_path(cfg, init_from=ckpt))
    assert len(paths) == 4


_REAL_RUN = prep._run_chunk
_CALLS = []


def _die_on_second_chunk(chunk):
    """Module level so the pool can pickle it by name; runs in forked workers."""
    _CALLS.append(1)
    if len(_CALLS) == 2:
        os._exit(3)  # a worker killed mid-way (OOM killer, node failure)
    return _REAL_RUN(chunk)


def test_a_killed_worker_leaves_no_cache_and_the_rerun_rebuilds(setup, monkeypatch):
    cfg, ckpt, tmp_path = setup
    cfg.prepare_workers = 2
    # Forked workers inherit the patch; each dies on its own second chunk.
    monkeypatch.setattr(prep, "_run_chunk", _die_on_second_chunk)
    target = prepared_path(cfg, init_from=ckpt)
    with pytest.raises(BrokenProcessPool):
        prepare_dataset(cfg, init_from=ckpt, progress=False)
    assert not os.path.exists(target)
    assert [n for n in os.listdir(cfg.cache_dir) if not n.endswith(".lock")] == []
    monkeypatch.undo()
    ds = prepare_dataset(cfg, init_from=ckpt, progress=False)
    assert ds.path == target and len(ds) == 309


def _prepare_and_die(cfg, ckpt):
    add = prep.PreparedWriter.add

    def add_then_die(self, *args):
        add(self, *args)
        os.kill(os.getpid(), signal.SIGKILL)  # the preparing process itself dies mid-write

    prep.PreparedWriter.add = add_then_die
    prepare_dataset(cfg, init_from=ckpt, progress=False)


def test_a_killed_preparing_process_leaves_a_temporary_that_the_rerun_replaces(setup):
    cfg, ckpt, _ = setup
    child = multiprocessing.get_context("fork").Process(target=_prepare_and_die, args=(cfg, ckpt))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    target = prepared_path(cfg, init_from=ckpt)
    left = [n for n in os.listdir(cfg.cache_dir) if n.startswith(".tmp-")]
    assert not os.path.exists(target) and len(left) == 1  # nothing that looks complete
    assert not is_complete(os.path.join(cfg.cache_dir, left[0]))
    with pytest.raises(DataError, match="not a complete prepared dataset"):
        PreparedDataset(os.path.join(cfg.cache_dir, left[0]))
    ds = prepare_dataset(cfg, init_from=ckpt, progress=False)
    assert ds.path == target and len(ds) == 309
    assert [n for n in os.listdir(cfg.cache_dir) if n.startswith(".tmp-")] == []


def test_one_process_prepares_while_the_others_wait_on_the_lock(setup):
    cfg, ckpt, _ = setup
    target = prepared_path(cfg, init_from=ckpt)
    os.makedirs(cfg.cache_dir, exist_ok=True)
    results = []
    with prep._locked(target + ".lock"):  # another process is preparing
        waiter = threading.Thread(target=lambda: results.append(prepare_dataset(cfg, init_from=ckpt,
                                                                                progress=False)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and not os.path.exists(target)
    waiter.join(60)
    assert results and results[0].path == target


BAD = [
    ({"messages": []}, "'messages' is an empty conversation; fix: "),
    ({"messages": [{"role": "robot", "content": "x"}]}, "'messages'[0] has unknown role 'robot'; fix: use one of"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "'conversations'[0] has unknown role 'bot'; fix: "),
    ({"messages": [{"role": "user"}]}, "'messages'[0] has no 'content'; fix: "),
    ({"messages": "hi"}, "'messages' must be a list of turns, got str; fix: "),
    ({"messages": [{"role": "user", "content": 3}]}, "'messages'[0]: 'content' must be a string, got int; fix: "),
    ({"text": "a", "messages": []}, "mixes the forms of keys ['text', 'messages']; fix: "),
]


def test_bad_records_are_reported_as_file_line_by_prepare(setup):
    cfg, ckpt, tmp_path = setup
    bad = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0]] + [r for r, _ in BAD])
    cfg.sources = [SourceConfig(bad, 1.0)]
    with pytest.raises(DataError) as err:
        prepare_dataset(cfg, init_from=ckpt, progress=False)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == len(BAD)
    for i, (line, (_, fragment)) in enumerate(zip(lines, BAD), start=2):
        assert line.strip().startswith(f"{bad}:{i}: ") and fragment in line, line
    assert os.listdir(cfg.cache_dir) == [os.path.basename(prepared_path(cfg, init_from=ckpt)) + ".lock"]


def test_missing_and_failing_templates_name_the_line(setup):
    cfg, ckpt, tmp_path = setup
    no_template = make_checkpoint(str(tmp_path / "bare"))
    data = write_jsonl(tmp_path / "chat.jsonl", [RECORDS[0], RECORDS[2]])
    cfg.sources = [SourceConfig(data, 1.0)]
    with pytest.raises(DataError, match=rf"{data}:2: a conversation needs a chat template.*; fix: set "
                                        "data.chat_template"):
        prepare_dataset(cfg, init_from=no_template, progress=False)
    failing = tmp_path / "strict.jinja"
    failing.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system "
                       "role') }}{% endif %}{{ m.content }}{% endfor %}")
    cfg.chat_template = str(failing)
    sysmsg = write_jsonl(tmp_path / "sys.jsonl", [RECORDS[2], {"messages": CONVERSATIONS[1]}])
    cfg.sources = [SourceConfig(sysmsg, 1.0)]
    with pytest.raises(DataError, match=rf"{sysmsg}:2: the chat template {failing} failed to render .*"
                                        "no system role.*; fix: "):
        prepare_dataset(cfg, init_from=no_template, progress=False)


def test_documents_without_targets_are_counted(setup):
    cfg, ckpt, tmp_path = setup
    data = write_jsonl(tmp_path / "few.jsonl", [{"text": ""}, {"messages": [{"role": "user", "content": "hi"}]},
                                                RECORDS[2], {"text": "x"}, {"text": ""}])
    cfg.sources = [SourceConfig(data, 1.0)]
    ds = prepare_dataset(cfg, init_from=ckpt, progress=False)
    assert ds.lengths[0] == 0 and ds.lengths[-1] == 0
    # "", a user-only chat, a 1-token text and the trailing "" have nothing to learn.
    assert ds.manifest["counts"]["documents_without_targets"] == 4
    assert ds.manifest["counts"]["documents"] == 5
