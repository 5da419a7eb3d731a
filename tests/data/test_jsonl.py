"""JSONL parsing: the two forms, and every kind of malformed line named by FILE:LINE."""

import json

import pytest

from megaft.data.errors import DataError
from megaft.data.jsonl import jsonl_problems, read_jsonl


def write(tmp_path, lines, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_reads_both_forms_skips_blank_lines_and_drops_extra_keys(tmp_path):
    path = write(tmp_path, [
        json.dumps({"text": "hello", "id": 7}),
        "",
        "   ",
        json.dumps({"prompt": "1+1=", "completion": "2", "meta": {"a": 1}}),
    ])
    assert read_jsonl(path) == [{"text": "hello"}, {"prompt": "1+1=", "completion": "2"}]
    assert read_jsonl(path, max_lines=1) == [{"text": "hello"}]
    assert jsonl_problems(path) == []


# (line, expected fragment of the problem)
MALFORMED = [
    ('{"text": "a"', "invalid JSON"),
    ('["text", "a"]', "expected a JSON object, got list"),
    ('"just a string"', "expected a JSON object, got str"),
    ('{"text": 3}', "'text' must be a string, got int"),
    ('{"prompt": "a", "completion": null}', "'completion' must be a string, got NoneType"),
    ('{"prompt": ["a"], "completion": "b"}', "'prompt' must be a string, got list"),
    ('{"prompt": "a"}', "has 'prompt' but no 'completion'"),
    ('{"completion": "a"}', "has 'completion' but no 'prompt'"),
    ('{"text": "a", "prompt": "b", "completion": "c"}',
     "has both 'text' and 'prompt'/'completion'"),
    ('{"body": "a"}', "has neither 'text' nor 'prompt'+'completion' nor 'messages' nor 'conversations' (keys: 'body')"),
    ('{}', "has neither"),
]


@pytest.mark.parametrize("line,fragment", MALFORMED)
def test_malformed_line_names_file_line_problem_and_fix(tmp_path, line, fragment):
    # The bad line is line 3 (after a good line and a blank one).
    path = write(tmp_path, [json.dumps({"text": "ok"}), "", line])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:3: ")
    assert fragment in msg
    assert "; fix: " in msg
    assert isinstance(err.value, ValueError)


def test_invalid_utf8_is_reported_with_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not valid UTF-8.*; fix: "):
        read_jsonl(str(path))


def test_missing_and_empty_files(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=rf"^{missing}: file not found; fix: "):
        read_jsonl(missing)
    empty = write(tmp_path, ["", "  "], name="empty.jsonl")
    with pytest.raises(DataError, match=rf"^{empty}: no examples .*; fix: "):
        read_jsonl(empty)


def test_jsonl_problems_lists_every_bad_line_then_caps(tmp_path):
    lines = [line for line, _ in MALFORMED] + [json.dumps({"text": "ok"})]
    path = write(tmp_path, lines)
    problems = jsonl_problems(path)
    where = [p.split(": ")[0] for p in problems]
    assert where == [f"{path}:{i}" for i in range(1, len(MALFORMED) + 1)]
    capped = jsonl_problems(path, limit=4)
    assert capped[:4] == problems[:4]
    assert capped[4] == f"{path}: {len(MALFORMED) - 4} more malformed lines not shown"
    assert len(capped) == 5
