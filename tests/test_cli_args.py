"""The argument errors megaft-chat and megaft-eval share (megaft.cli_args): a bad override is
one line, the checks' problems a list, and the status 2, before anything slow is loaded."""
from __future__ import annotations

from megaft.chat.cli import main as chat_main
from megaft.cli_args import checked_arguments
from megaft.eval.cli import main as eval_main


def _bad(text: str):
    raise ValueError(text)


def test_checked_arguments_reports_a_parse_error_or_every_problem(capsys):
    assert checked_arguments("prog", lambda: 3, lambda n: []) == 3
    assert capsys.readouterr().err == ""
    assert checked_arguments("prog", lambda: _bad("no such key"), lambda n: ["unseen"]) is None
    assert capsys.readouterr().err == "prog: no such key\n"
    assert checked_arguments("prog", lambda: 3, lambda n: [f"{n} is odd", "and small"]) is None
    assert capsys.readouterr().err == "prog: invalid arguments:\n  - 3 is odd\n  - and small\n"


def test_chat_and_eval_report_alike(tmp_path, capsys):
    assert chat_main([str(tmp_path), "pipeline.pp=2"]) == 2
    assert capsys.readouterr().err.startswith("megaft-chat: unknown setting(s) pipeline.pp=2")
    assert chat_main([str(tmp_path), "--temp", "-1", "--top-p", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megaft-chat: invalid arguments:\n  - --temp -1") and "\n  - --top-p 0" in err
    assert eval_main([str(tmp_path), "tasks=[megaft_arith]"]) == 2
    assert capsys.readouterr().err.startswith("megaft-eval: not an eval.KEY=VALUE override")
    assert eval_main([str(tmp_path), "eval.tasks=[no_such_task]"]) == 2
    assert capsys.readouterr().err.startswith("megaft-eval: invalid arguments:\n  - ")
