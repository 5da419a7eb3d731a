"""train.then_eval=true on the real single-host Slurm: the launcher queues a megaft-eval job
per point with --dependency=afterok on that point's training job; it starts only after
training ended, writes RUN_DIR/eval/results.json, and megaft-report shows its score. The
run also keeps its last checkpoint: megaft-eval's one-process export of it (what a run
without train.export_hf is evaluated on) equals the trained job's own export."""
import json
import os
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from megaft.eval.model_dir import export_checkpoint

from .conftest import ROOT
from .test_slurm import job_fields
from .test_sweep import multirun, queued

pytest.importorskip("lm_eval")


def test_eval_job_runs_after_training(slurm_cluster, tmp_path):
    env = slurm_cluster
    out, _ = multirun(env, tmp_path, "train.export_hf=true", "train.save_every=3", "train.then_eval=true",
                      "eval.tasks=[megaft_arith]", "eval.limit=4", "eval.device=cpu", "eval.timeout_min=10",
                      timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    [point] = json.loads((tmp_path / "submitted.json").read_text())["points"]
    train, evaluation = point["job_id"], point["eval_job_id"]
    fields = job_fields(env, evaluation)
    assert fields["Dependency"] in (f"afterok:{train}(unfulfilled)", "(null)"), fields  # (null): already met
    deadline = time.monotonic() + 540
    while queued(env, [train, evaluation]):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", train.split("_")[0], evaluation], env=env, check=False)
            pytest.fail(f"jobs {train} {evaluation} still queued after 540 s (cancelled)")
        time.sleep(1)
    trained, evaluated = job_fields(env, train), job_fields(env, evaluation)
    assert trained["JobState"] == "COMPLETED" and evaluated["JobState"] == "COMPLETED", (trained, evaluated)
    assert evaluated["StartTime"] >= trained["EndTime"]  # ISO timestamps: string order is time order
    run_dir = point["run_dir"]
    results = json.loads(open(os.path.join(run_dir, "eval", "results.json")).read())
    assert results["megaft"]["origin"] == "hf" and results["results"]["megaft_arith"]["sample_len"] == 4
    report = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "megaft.report", str(tmp_path),
                             "--no-plot"], env=env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "megaft_arith/acc" in report.stdout
    row = json.loads((tmp_path / "report.json").read_text())[0]
    assert row["status"] == "done" and row["megaft_arith/acc"] == results["results"]["megaft_arith"]["acc,none"]
    ckpt = os.path.join(run_dir, "checkpoints", "step_000003")  # the tp=1 run's checkpoint, exported here
    exported = export_checkpoint(run_dir, ckpt, str(tmp_path / "from_checkpoint"))
    ours, theirs = load_file(os.path.join(exported, "model.safetensors")), load_file(os.path.join(run_dir, "hf",
                                                                                                 "model.safetensors"))
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_invalid_then_eval_submits_nothing(slurm_cluster, tmp_path):
    # without a checkpoint at the end (train.save_final=false) and no export there is nothing to evaluate
    out, _ = multirun(slurm_cluster, tmp_path, "train.then_eval=true", "eval.tasks=[no_such_task]",
                      "train.save_final=false")
    assert out.returncode == 2
    assert "train.then_eval=true needs a model to evaluate" in out.stderr and "unknown task(s) no_such_task" in \
        out.stderr
    assert [p["status"] for p in json.loads((tmp_path / "submitted.json").read_text())["points"]] == ["invalid"]
