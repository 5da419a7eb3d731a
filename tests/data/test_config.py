"""DataConfig: check_data reports every problem at once; building tokenizer and examples."""

import json

from megaft.config.data import DataConfig
from megaft.data.build import build_tokenizer, load_examples
from megaft.data.checks import check_data
from megaft.data.tasks import make_task
from megaft.data.tokenizer import char_tokenizer


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_defaults_are_valid_and_generate_the_addition_task():
    cfg = DataConfig()
    assert check_data(cfg) == []
    train, eval_, task = load_examples(cfg)
    assert task.name == "addition" and len(train) == 20000 and len(eval_) == 256
    assert eval_ == make_task("addition", 20000, 256, 1234).eval
    tok = build_tokenizer(cfg)
    assert tok.decode(tok.encode("12+34=").ids) == "12+34="


def test_check_data_reports_every_problem_at_once(tmp_path):
    train = write(tmp_path / "train.jsonl", [
        json.dumps({"text": "ok"}),
        "{broken",
        json.dumps({"prompt": "a"}),
    ])
    cfg = DataConfig(path=train, eval_path=str(tmp_path / "missing.jsonl"),
                     tokenizer=str(tmp_path / "no_tok.json"), seq_len=1, task="nope",
                     eval_max_lines=0)
    problems = check_data(cfg)
    expected_starts = [
        "data.seq_len=1 is too short; fix: ",
        "data.task='nope' is not a known task; fix: use one of ['addition', 'reverse']",
        "data.eval_max_lines=0; fix: ",
        f"data.path: {train}:2: invalid JSON",
        f"data.path: {train}:3: has 'prompt' but no 'completion'; fix: ",
        f"data.eval_path: {tmp_path / 'missing.jsonl'}: file not found; fix: ",
        f"data.tokenizer: {tmp_path / 'no_tok.json'}: tokenizer file not found; fix: ",
    ]
    assert len(problems) == len(expected_starts), problems
    for problem, start in zip(problems, expected_starts):
        assert problem.startswith(start), (problem, start)
        assert "fix: " in problem


def test_check_data_task_sizes():
    problems = check_data(DataConfig(task="addition", task_train_size=0, task_eval_size=5001))
    assert len(problems) == 2
    assert problems[0].startswith("data.task_train_size=0; fix: ")
    assert problems[1].startswith("data.task_eval_size=5001 but task 'addition' holds out at most")
    assert problems[1].endswith("fix: set it in [0, 5000]")
    assert check_data(DataConfig(task="addition", task_eval_size=5000)) == []


def test_file_data_outside_the_task_alphabet_needs_a_tokenizer(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"prompt": "1+1=", "completion": "two"})])
    [problem] = check_data(DataConfig(path=path))
    assert "outside the 'addition' task's alphabet ('otw')" in problem
    assert "fix: set data.tokenizer" in problem
    # An explicit tokenizer, or an HF checkpoint's, lifts it.
    tok_path = str(tmp_path / "tok.json")
    char_tokenizer("0123456789+=otw").save(tok_path)
    assert check_data(DataConfig(path=path, tokenizer=tok_path)) == []
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    [problem] = check_data(DataConfig(path=path), init_from=str(ckpt))
    assert problem.startswith(
        f"the tokenizer of model.init_from: {ckpt / 'tokenizer.json'}: tokenizer file not found")
    char_tokenizer("0123456789+=otw").save(str(ckpt / "tokenizer.json"))
    assert check_data(DataConfig(path=path), init_from=str(ckpt)) == []
    assert build_tokenizer(DataConfig(path=path), init_from=str(ckpt)).token_to_id("w") is not None


def test_load_examples_from_files(tmp_path):
    train = write(tmp_path / "train.jsonl", [json.dumps({"text": t}) for t in ("abc", "de")])
    evals = write(tmp_path / "eval.jsonl",
                  [json.dumps({"prompt": str(i), "completion": "x"}) for i in range(5)])
    cfg = DataConfig(path=train, eval_path=evals, eval_max_lines=3)
    train_ex, eval_ex, task = load_examples(cfg)
    assert task is None
    assert train_ex == [{"text": "abc"}, {"text": "de"}]
    assert eval_ex == [{"prompt": str(i), "completion": "x"} for i in range(3)]
    assert load_examples(DataConfig(path=train)).eval == []
