"""megaft-eval: the example tasks on a tiny random Llama give the numbers `lm_eval` itself
gives on the same folder; its errors; the report's score columns; train.then_eval's checks.
(The dependent Slurm job: tests/slurm/test_then_eval.py.)"""
import glob
import json
import os
import subprocess
import sys

import pytest
from models.hf_fixture import make_hf_llama  # tests/ is on sys.path (rootdir conftest)

from megaft.config.eval import EvalConfig
from megaft.eval.checks import check_then_eval, tasks_dir
from megaft.eval.cli import main, parse_overrides
from megaft.report.collect import collect
from megaft.report.render import format_table

LM_EVAL = os.path.join(os.path.dirname(sys.executable), "lm_eval")
TASKS = "megaft_arith,megaft_copy"
LIMIT = 8  # documents per task: enough for non-trivial numbers, seconds on a loaded CPU


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run dir (metrics.jsonl) whose hf/ holds a tiny random Llama with megaft's kind of
    tokenizer folder (tokenizer.json only), evaluated once by megaft-eval."""
    pytest.importorskip("lm_eval")
    run = tmp_path_factory.mktemp("run")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 4.0, "tokens_per_s": 10.0}) + "\n")
    make_hf_llama(str(run / "hf"))
    assert main([str(run), f"eval.tasks=[{TASKS}]", "eval.device=cpu", f"eval.limit={LIMIT}"]) == 0
    return run


def test_equals_lm_eval_by_hand(run_dir, tmp_path):
    ours = json.loads((run_dir / "eval" / "results.json").read_text())
    assert ours["megaft"]["model"] == str(run_dir / "hf") and ours["megaft"]["origin"] == "hf"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([LM_EVAL, "--model", "hf", "--model_args", f"pretrained={run_dir / 'hf'}", "--tasks", TASKS,
                          "--include_path", tasks_dir(), "--device", "cpu", "--batch_size", "8", "--limit",
                          str(LIMIT), "--output_path", str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [path] = glob.glob(str(tmp_path / "**" / "results_*.json"), recursive=True)
    theirs = json.loads(open(path).read())
    assert set(ours["results"]) == {"megaft_arith", "megaft_copy"}
    for task in ours["results"]:  # the same numbers, exactly (same model, data, order, batch)
        assert ours["results"][task] == theirs["results"][task], task
    assert ours["results"]["megaft_arith"]["sample_len"] == LIMIT


def test_report_shows_scores(run_dir, tmp_path):
    other = tmp_path / "sweep" / "0"  # a run without eval results: the same columns, empty
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0, "tokens_per_s": 10.0}) + "\n")
    rows = collect(str(run_dir)) + collect(str(tmp_path / "sweep"))
    scores = json.loads((run_dir / "eval" / "results.json").read_text())["results"]
    assert rows[0]["megaft_arith/acc"] == scores["megaft_arith"]["acc,none"]
    assert rows[0]["megaft_copy/exact_match@remove_whitespace"] == scores["megaft_copy"][
        "exact_match,remove_whitespace"]
    assert "megaft_arith/acc" not in rows[1]  # collected separately: no eval column at all
    table = format_table(collect(str(run_dir)))
    assert "megaft_arith/acc" in table and "megaft_arith/acc_norm" in table and "stderr" not in table


def test_errors(run_dir, tmp_path, capsys, monkeypatch):
    assert main([str(run_dir), "eval.tasks=[megaft_arith,no_such_task]"]) == 2
    err = capsys.readouterr().err
    assert "unknown task(s) no_such_task" in err and "megaft_arith, megaft_copy" in err
    empty = tmp_path / "empty_run"  # a run dir without hf/ or a checkpoint
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert main([str(empty), "eval.tasks=[megaft_arith]"]) == 2
    assert "has no model to evaluate" in capsys.readouterr().err
    assert main([str(tmp_path), "eval.tasks=[megaft_arith]"]) == 2  # neither a run dir nor an HF folder
    assert "neither a run dir" in capsys.readouterr().err
    assert main([str(run_dir), "tasks=[megaft_arith]"]) == 2
    assert "eval.KEY=VALUE" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    assert main([str(run_dir), "eval.tasks=[megaft_arith]"]) == 2
    assert "pip install lm_eval" in capsys.readouterr().err


def test_overrides_and_then_eval_checks(tmp_path):
    cfg = parse_overrides(["eval.tasks=[megaft_arith,megaft_copy]", "eval.batch_size=4", "eval.limit=3"])
    assert (cfg.tasks, cfg.batch_size, cfg.limit) == (["megaft_arith", "megaft_copy"], 4, 3)
    with pytest.raises(ValueError):
        parse_overrides(["eval.batch_size=many"])
    ok = EvalConfig(tasks=["megaft_arith"])
    base = dict(then_eval=True, export_hf=True, lora_rank=0, export_merged=False, save_every=0)
    assert check_then_eval(ok, **base) == []
    assert check_then_eval(ok, **dict(base, then_eval=False, export_hf=False)) == []
    assert "train.export_hf=true" in check_then_eval(ok, **dict(base, export_hf=False))[0]
    assert check_then_eval(ok, **dict(base, export_hf=False, save_every=5)) == []
    assert "lora.export_merged=true" in check_then_eval(ok, **dict(base, lora_rank=8))[0]
    assert check_then_eval(ok, **dict(base, lora_rank=8, export_merged=True)) == []
    [problem] = check_then_eval(EvalConfig(tasks=[]), **base)
    assert "eval.tasks is empty" in problem
    (tmp_path / "mine.yaml").write_text("task: my_task\ndataset_path: json\n")
    assert check_then_eval(EvalConfig(tasks=["my_task"], include=str(tmp_path)), **base) == []


def test_eval_job_parameters():
    from megaft.eval.submit import eval_parameters

    preset = dict(job_name="megaft", cpus_per_task=2, setup=["module load x"], additional_parameters={"qos": "hi"},
                  partition="gpu", gpus_per_node=4, mem_gb=0)
    params = eval_parameters(EvalConfig(tasks=["megaft_arith"], timeout_min=7), preset, "123_4")
    assert params["additional_parameters"] == {"qos": "hi", "dependency": "afterok:123_4"}  # its own array task
    assert (params["job_name"], params["nodes"], params["ntasks_per_node"], params["gpus_per_node"],
            params["time"], params["partition"]) == ("megaft-eval", 1, 1, 1, 7, "gpu")
    cpu = eval_parameters(EvalConfig(gpus=-1), dict(preset, gpus_per_node=0, partition=None), "5")
    assert "gpus_per_node" not in cpu and "partition" not in cpu


def test_then_eval_after_a_local_run(tmp_path):
    """train.then_eval=true on a local run: megaft-eval runs on the run dir once training finished."""
    from train_cases import small_config

    from megaft.train import run

    cfg = small_config(steps=2)
    cfg.parallel.tp, cfg.launcher.nproc, cfg.device = 1, 1, "cpu"
    cfg.train.export_hf, cfg.train.then_eval = True, True
    cfg.eval.tasks, cfg.eval.limit, cfg.eval.device = ["megaft_arith"], 4, "cpu"
    run(cfg, str(tmp_path / "run"))
    results = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert results["megaft"]["origin"] == "hf" and results["results"]["megaft_arith"]["sample_len"] == 4
