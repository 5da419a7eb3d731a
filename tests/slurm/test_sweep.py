"""A Hydra multirun through megaft's Slurm launcher on the real single-host Slurm:
one job array per resource shape, invalid points rejected before sbatch, every job
its own run dir and port, `megaft-report` over the sweep.

One sweep serves all tests: parallel.tp=1,2,3 x train.seed=0,1 (Hydra varies the last
override fastest; tp=3 cannot split 4 heads), so two arrays of two jobs each (1-rank
and 2-rank jobs) on the node's 2 CPUs.
"""
import json
import os
import subprocess
import time

import pytest

from megaft.launch.submit import task_port

from .conftest import ROOT
from .test_slurm import job_fields

TRAIN = os.path.join(ROOT, ".venv", "bin", "megaft-train")
TINY = ["device=cpu", "model.dim=64", "model.n_layers=1", "data.task_train_size=500", "data.task_eval_size=16",
        "data.seq_len=32", "train.max_steps=3", "train.progress=false", "hydra.launcher.timeout_min=5"]


def queued(env, job_ids):
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30)
    return set(out.stdout.split()) & set(job_ids)


def multirun(env, sweep_dir, *overrides, timeout=120):
    started = time.monotonic()
    out = subprocess.run([TRAIN, "-m", "hydra/launcher=slurm_cpu", f"hydra.launcher.job_name=megaft-test-{os.getpid()}",
                          f"hydra.sweep.dir={sweep_dir}", *TINY, *overrides],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - started


@pytest.fixture(scope="module")
def sweep(slurm_cluster, tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("sweep")
    out, elapsed = multirun(slurm_cluster, sweep_dir, "parallel.tp=1,2,3", "train.seed=0,1")
    record = json.loads((sweep_dir / "submitted.json").read_text())
    jobs = [p["job_id"] for p in record["points"] if p["status"] == "submitted"]
    in_queue_at_return = queued(slurm_cluster, jobs)
    deadline = time.monotonic() + 480
    while queued(slurm_cluster, jobs):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *{j.split("_")[0] for j in jobs}], env=slurm_cluster, check=False)
            pytest.fail(f"sweep jobs {jobs} still queued after 480 s (cancelled)")
        time.sleep(0.5)
    return dict(dir=sweep_dir, out=out, elapsed=elapsed, record=record, jobs=jobs, queued=in_queue_at_return,
                env=slurm_cluster)


def test_wait_false_returns_after_submission(sweep):
    out = sweep["out"]
    assert out.returncode == 2, out.stderr[-3000:]  # 2: some points were invalid
    assert sweep["queued"], "no job was still queued when megaft-train returned"
    assert "2 of 6 point(s) invalid" in out.stderr


def test_one_array_per_shape(sweep):
    arrays = sweep["record"]["arrays"]
    assert [(a["shape"]["world_size"], a["points"]) for a in arrays] == [(1, [0, 1]), (2, [2, 3])]
    for array in arrays:
        for task in (0, 1):
            fields = job_fields(sweep["env"], f"{array['array_job_id']}_{task}")
            assert fields["ArrayJobId"] == array["array_job_id"] and fields["ArrayTaskId"] == str(task)
            assert fields["NumTasks"] == str(array["shape"]["world_size"])
            assert fields["JobState"] == "COMPLETED", fields


def test_invalid_points_not_submitted(sweep):
    invalid = [p for p in sweep["record"]["points"] if p["status"] == "invalid"]
    assert [p["num"] for p in invalid] == [4, 5]
    for p in invalid:
        assert "parallel.tp=3" in p["overrides"] and f"point #{p['num']} ({p['overrides']})" in sweep["out"].stderr
        assert any("does not divide model.n_heads=4" in problem for problem in p["problems"])
        assert not os.path.exists(p["run_dir"])


def test_each_point_trains_in_its_run_dir(sweep):
    for p in sweep["record"]["points"]:
        if p["status"] != "submitted":
            continue
        summary = json.loads(open(os.path.join(p["run_dir"], "summary.json")).read())
        tp = int(p["overrides"].split("parallel.tp=")[1].split()[0])
        assert (summary["tp"], summary["world_size"], summary["steps"]) == (tp, tp, 3)
        with open(os.path.join(p["run_dir"], "metrics.jsonl")) as f:
            steps = [json.loads(line).get("step") for line in f if "loss" in json.loads(line)]
        assert steps == [1, 2, 3]


def test_jobs_get_their_own_ports(sweep):
    seen = [json.loads(open(os.path.join(p["run_dir"], "slurm.json")).read())
            for p in sweep["record"]["points"] if p["status"] == "submitted"]
    ports = [s["port"] for s in seen]
    assert len(set(ports)) == len(ports) == 4, seen
    assert all(s["port"] == task_port(s["slurm_job_id"]) for s in seen)
    assert all(s["init_method"] == f"tcp://{s['hostnames'][0]}:{s['port']}" for s in seen)


def test_report_lists_the_sweep(sweep):
    out = subprocess.run([os.path.join(ROOT, ".venv", "bin", "megaft-report"), str(sweep["dir"])], cwd=ROOT,
                         env=sweep["env"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads((sweep["dir"] / "report.json").read_text())
    assert [r["status"] for r in rows] == ["done"] * 4 + ["invalid"] * 2, out.stdout
    assert all(r["tokens_per_s"] > 0 for r in rows if r["status"] == "done")
    assert (sweep["dir"] / "report.png").exists() and (sweep["dir"] / "report.csv").exists()


def test_wait_true_returns_when_the_job_ended(slurm_cluster, tmp_path):
    out, _ = multirun(slurm_cluster, tmp_path, "parallel.tp=1", "train.max_steps=2", "hydra.launcher.wait=true",
                      timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["steps"] == 2
