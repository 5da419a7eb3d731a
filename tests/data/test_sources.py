"""Sources (JSONL, Parquet, directories), the new DataConfig fields, and megaft-prepare."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megaft.config.data import DataConfig, SourceConfig
from megaft.data.build import load_examples
from megaft.data.checks import check_data
from megaft.data.encode import encode_examples
from megaft.data.errors import DataError
from megaft.data.sources import read_source, source_files
from megaft.data.tokenizer import char_tokenizer
from tests.data.chat_fixture import CHATML_PLAIN, CONVERSATIONS, make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_directories_and_parquet_read_in_sorted_order(tmp_path):
    (tmp_path / "d" / "z").mkdir(parents=True)
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "b"}])
    write_jsonl(tmp_path / "d" / "z" / "a.jsonl", [{"text": "za"}])
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    pq.write_table(pa.Table.from_pydict({"conversations": [conv, None], "prompt": [None, "p"],
                                         "completion": [None, "c"]}), str(tmp_path / "d" / "a.parquet"))
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    assert [os.path.relpath(f, tmp_path) for f in source_files(str(tmp_path / "d"))] == [
        "d/a.parquet", "d/b.jsonl", "d/z/a.jsonl"]
    # Parquet columns absent from a row come back as None: the form is still recognized.
    assert read_source(str(tmp_path / "d")) == [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"prompt": "p", "completion": "c"}, {"text": "b"}, {"text": "za"}]


def test_source_path_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: directory holds no .jsonl or .parquet files; fix: "):
        source_files(str(tmp_path / "empty"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"x.csv: unknown file type; fix: use .jsonl"):
        source_files(str(tmp_path / "x.csv"))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "ok"}, {"text": None}]), str(bad))
    with pytest.raises(DataError, match=rf"^{bad}:2: has neither 'text' nor .*\(keys: none\); fix: "):
        read_source(str(bad))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"junk.parquet: cannot read Parquet .*; fix: "):
        read_source(str(tmp_path / "junk.parquet"))


def test_sharegpt_maps_roles():
    from megaft.data.formats import parse_record

    conv = [{"from": "system", "value": "s"}, {"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]
    assert parse_record({"conversations": conv, "id": 3}) == {"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "h"}, {"role": "assistant", "content": "g"}]}


def test_load_examples_mixes_sources_by_weight(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(4)])
    cfg = DataConfig(sources=[SourceConfig(a, 3), SourceConfig(b, 0.5)])
    train = load_examples(cfg).train
    assert train.count({"text": "a"}) == 3 and len(train) == 5
    assert load_examples(cfg).train == train  # deterministic
    with pytest.raises(DataError, match="a conversation needs a chat template.*fix: set data.chat_template"):
        encode_examples(char_tokenizer("ab"), [{"messages": CONVERSATIONS[0]}], None)


def test_check_data_new_fields_every_problem_with_a_fix(tmp_path):
    good = write_jsonl(tmp_path / "g.jsonl", [{"text": "ab"}])
    cfg = DataConfig(path=good, sources=[SourceConfig(good, 0)], train_on="most", packing="tight",
                     long_docs="fold", chat_template="nope.jinja", prepare_workers=-1, task="reverse")
    problems = check_data(cfg)
    expected = ["data.train_on='most' is unknown; fix: use one of ['assistant', 'all', 'last']",
                "data.packing='tight' is unknown; fix: use one of ['docs', 'stream', 'none']",
                "data.long_docs='fold' is unknown; fix: use one of ['split', 'truncate', 'drop']",
                "data.chat_template='nope.jinja' is neither auto, llama3, chatml nor an existing .jinja file; fix: ",
                "data.prepare_workers=-1; fix: ", "data.path and data.sources are both set; fix: ",
                "data.sources[0].weight=0; fix: "]
    assert len(problems) == len(expected), problems
    for p, e in zip(problems, expected):
        assert p.startswith(e), (p, e)
    assert check_data(DataConfig()) == []  # the demo's defaults stay valid


def test_check_data_reports_at_most_20_bad_lines_over_all_sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ['{"messages": []}'] * 15)
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "ab"}] + [{"messages": [{"role": "x", "content": ""}]}] * 10
                    + [{"messages": [{"role": "user", "content": "ab"}]}])
    problems = check_data(DataConfig(sources=[SourceConfig(a), SourceConfig(b)], task="reverse"))
    assert len(problems) == 22
    assert problems[0] == f"data.sources[0]: {a}:1: 'messages' is an empty conversation; fix: give it at " \
                          "least one turn, or drop the line"
    assert problems[15] == f"data.sources[1]: {b}:2: 'messages'[0] has unknown role 'x'; fix: use one of " \
                           "['system', 'user', 'assistant', 'tool']"
    assert problems[20] == f"data.sources[1]: {b}: 5 more malformed lines not shown"
    assert problems[21].startswith("data.chat_template=auto: the data holds conversations but the task "
                                   "tokenizer has no chat template")


def test_check_data_chat_templates(tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    bare = make_checkpoint(str(tmp_path / "bare"))
    [problem] = check_data(DataConfig(path=data), init_from=bare)
    assert problem.startswith(f"data.chat_template=auto: the data holds conversations but {bare} has no chat")
    assert "fix: set data.chat_template=llama3, chatml or a .jinja file" in problem
    assert check_data(DataConfig(path=data, chat_template="chatml"), init_from=bare) == []
    assert check_data(DataConfig(path=data), init_from=make_checkpoint(str(tmp_path / "t"), CHATML_PLAIN)) == []
    # A built-in template whose turn markers the vocabulary lacks.
    tok = tmp_path / "tok.json"
    char_tokenizer("abcdefghijklmnopqrstuvwxyz ?.").save(str(tok))
    [problem] = check_data(DataConfig(path=data, tokenizer=str(tok), chat_template="llama3"))
    assert "writes ['<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>'], which the tokenizer does " \
           "not have as tokens; fix: " in problem
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    [problem] = check_data(DataConfig(path=data, chat_template=str(broken)), init_from=bare)
    assert problem.startswith(f"data.chat_template: {broken}: the chat template does not compile")


def test_hydra_chat_preset_and_sources_override(tmp_path):
    from megaft.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        demo = OmegaConf.to_object(compose(config_name="train"))
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=[
            "data=chat", "data.path=null", "data.sources=[{path: a.jsonl, weight: 3}, {path: dir}]"]))
    assert demo.data.packing == "stream" and demo.data.sources == [] and demo.data.path is None
    data = cfg.data
    assert isinstance(data, DataConfig) and data.packing == "docs" and data.train_on == "assistant"
    assert [(s.path, s.weight) for s in data.sources] == [("a.jsonl", 3.0), ("dir", 1.0)]
    assert isinstance(data.sources[0], SourceConfig)


def test_megaft_prepare_entry_point(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), CHATML_PLAIN)
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    cmd = [sys.executable, "-m", "megaft.prepare", "data=chat", f"data.path={data}", f"model.init_from={ckpt}",
           f"data.cache_dir={tmp_path / 'cache'}", "data.prepare_workers=1", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    [line] = [x for x in out.stdout.splitlines() if x.startswith("megaft-prepare:")]
    path = line.rsplit(" in ", 1)[1]
    assert line.startswith("megaft-prepare: 3 documents") and os.path.isfile(os.path.join(path, "manifest.json"))
    bad = subprocess.run(cmd[:3] + [f"data.path={tmp_path / 'missing.jsonl'}"] + cmd[5:], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=120)
    assert bad.returncode == 2 and "missing.jsonl: file not found; fix: " in bad.stderr


def test_datasets_save_to_disk_directories_are_read_with_pyarrow(tmp_path):
    """The layout `datasets` writes (state.json listing Arrow IPC stream shards; a DatasetDict's
    dataset_dict.json over split directories), built here with pyarrow alone."""
    split = tmp_path / "dd" / "train"
    split.mkdir(parents=True)
    table = pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS])
    for i, part in enumerate((table.slice(0, 2), table.slice(2))):
        with pa.ipc.new_stream(str(split / f"data-0000{i}-of-00002.arrow"), table.schema) as w:
            w.write_table(part)
    (split / "state.json").write_text(json.dumps({"_data_files": [
        {"filename": "data-00000-of-00002.arrow"}, {"filename": "data-00001-of-00002.arrow"}], "_split": "train"}))
    (split / "dataset_info.json").write_text("{}")
    want = [{"messages": c} for c in CONVERSATIONS]
    assert read_source(str(split)) == want
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert read_source(str(tmp_path / "dd")) == want
    (tmp_path / "nt").mkdir()
    (tmp_path / "nt" / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    with pytest.raises(DataError, match="a saved DatasetDict without a 'train' split; fix: "):
        source_files(str(tmp_path / "nt"))
    # ... and prepared like any other source.
    from tokenizers import Tokenizer

    from megaft.data.build import chat_encoder
    from megaft.data.prepare import prepare_dataset

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), CHATML_PLAIN)
    cfg = DataConfig(path=str(tmp_path / "dd"), cache_dir=str(tmp_path / "cache"), prepare_workers=1)
    ds = prepare_dataset(cfg, init_from=ckpt, progress=False)
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    encoder = chat_encoder(cfg, tok, init_from=ckpt)
    assert [ds.encoded(i) for i in range(len(ds))] == encode_examples(tok, want, None, encoder)
    assert [f["records"] for f in ds.manifest["files"]] == [2, 1]
