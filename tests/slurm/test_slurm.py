"""megaft under a real Slurm: every task of `srun` is one rank (megaft/launch/env.py).

Needs the single-host cluster of slurm/cluster.sh (fixture `slurm_cluster`). Jobs get
absolute paths to the venv's interpreter and the repo root as working directory.
"""
import json
import os
import re
import subprocess
import time

import pytest

from megaft.launch.env import slurm_port

from .conftest import PYTHON, ROOT

TINY = ["model.dim=64", "model.n_layers=1", "data.task_train_size=500", "data.task_eval_size=16",
        "train.max_steps=2", "data.seq_len=32", "train.progress=false", "parallel.tp=2"]


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def job_fields(env, job):
    """`scontrol show job` as a dict (no accounting daemon here: sacct cannot answer)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                         check=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S+)", out.stdout))


def final_state(env, job, timeout=120.0):
    """The job's state once it left PENDING/RUNNING/COMPLETING (the launcher's wait=true returns
    with rank 0's result, possibly while the other tasks and the job's epilogue still run)."""
    deadline = time.monotonic() + timeout
    while True:
        state = job_fields(env, job)["JobState"]
        if state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def ctld_log(env, job):
    """slurmctld's log lines about `job`: why Slurm ended or killed it (for failure messages)."""
    conf = subprocess.run(["scontrol", "show", "config"], env=env, capture_output=True, text=True, timeout=30)
    path = dict(re.findall(r"^(\w+)\s+=\s+(\S+)", conf.stdout, re.M)).get("SlurmctldLogFile")
    if not path or not os.path.exists(path):
        return f"(no slurmctld log: SlurmctldLogFile={path})"
    with open(path, errors="replace") as f:
        return "".join(line for line in f if re.search(rf"JobId={job}\b", line))[-3000:]


def run_job(env, *args, timeout=240):
    """Submit from the repo root and wait until the job ends: (job id, its scontrol fields).

    Polls scontrol every 0.2 s rather than `sbatch --wait`, whose backoff (2, 4, 8... s)
    can add half a minute to a 10-second job.
    """
    out = subprocess.run(["sbatch", "--parsable", "--time=5", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    job = out.stdout.strip().split(";")[0]
    assert out.returncode == 0 and job.isdigit(), f"sbatch failed: {out.stdout!r} {out.stderr!r}"
    deadline = time.monotonic() + timeout
    while (fields := job_fields(env, job))["JobState"] not in FINISHED:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, check=False)
            pytest.fail(f"job {job} still {fields['JobState']} after {timeout}s (cancelled)")
        time.sleep(0.2)
    return job, fields


def rank_lines(text):
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("megaft-rank ")]


@pytest.fixture(scope="module")
def srun_job(slurm_cluster, tmp_path_factory):
    """slurm/train_srun.sbatch run once: 2 tasks, tp=2, the tiny model."""
    tmp = tmp_path_factory.mktemp("srun")
    env = dict(slurm_cluster, RUN_DIR=str(tmp / "run"))
    # launcher.nproc=1: if megaft-train did not take its rank from Slurm, the local
    # launcher would start one rank and validation (tp=2 on world 1) would fail.
    job, fields = run_job(env, f"--output={tmp}/slurm-%j.out", "slurm/train_srun.sbatch",
                          *TINY, "launcher.nproc=1")
    return job, fields, (tmp / f"slurm-{job}.out").read_text(), tmp / "run"


def test_sbatch_srun_job_completes(srun_job):
    _, fields, out, _ = srun_job
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", out[-3000:]
    assert fields["NumTasks"] == "2", fields


def test_each_slurm_task_is_one_rank(srun_job):
    job, _, out, _ = srun_job
    ranks = rank_lines(out)  # printed by `srun python -m megaft.launch.env` (step 0)
    assert sorted(r["rank"] for r in ranks) == [0, 1], out[-3000:]
    assert {r["world_size"] for r in ranks} == {2}
    assert sorted(r["local_rank"] for r in ranks) == [0, 1]
    (init,) = {r["init_method"] for r in ranks}  # both tasks agree on the rendezvous
    assert re.fullmatch(rf"tcp://{re.escape(os.uname().nodename.split('.')[0])}:{slurm_port(job, '0')}", init)


def test_two_slurm_ranks_train_tp2(srun_job):
    _, fields, out, run = srun_job
    assert fields["ExitCode"] == "0:0", out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tp"] == 2 and summary["steps"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def test_batch_script_and_single_task_are_not_ranks(slurm_cluster, tmp_path):
    # The batch script of a 2-task job runs once (no SLURM_STEP_ID), and `srun -n 1` is
    # a 1-task step: both must leave the ranks to megaft's local launcher.
    cmd = f"{PYTHON} -m megaft.launch.env && srun -n 1 {PYTHON} -m megaft.launch.env"
    job, fields = run_job(slurm_cluster, "--ntasks=2", f"--output={tmp_path}/out-%j", f"--wrap={cmd}")
    out = (tmp_path / f"out-{job}").read_text()
    assert fields["ExitCode"] == "0:0", out
    assert rank_lines(out) == [None, None], out
