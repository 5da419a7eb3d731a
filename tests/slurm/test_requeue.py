"""Preemption under a real Slurm: USR1 mid-run -> every rank saves, rank 0 requeues, the job resumes.

Two 2-task jobs of slurm/train_srun.sbatch (tp=2): one uninterrupted, one that gets
`scancel --signal=USR1` (what `#SBATCH --signal=USR1@120` sends before the time limit)
once it has logged a few steps. Slurm holds a requeued job for about two minutes
(Reason=BeginTime); the test releases it with `scontrol update StartTime=now`.
"""
import json
import subprocess
import time

import pytest

from .test_slurm import FINISHED, TINY, job_fields, run_job
from .conftest import ROOT

STEPS = 40
ARGS = [a for a in TINY if not a.startswith("train.max_steps")] + [
    f"train.max_steps={STEPS}", "train.eval_every=10", "model.n_layers=2", "launcher.max_requeue=1"]


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r], [(r["step"], r["eval_loss"]) for r in rows
                                                                     if "eval_loss" in r]


def submit(env, *args):
    out = subprocess.run(["sbatch", "--parsable", "--time=5", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    job = out.stdout.strip().split(";")[0]
    assert out.returncode == 0 and job.isdigit(), f"sbatch failed: {out.stdout!r} {out.stderr!r}"
    return job


def wait_for(what, check, job, env, timeout=240, poll=0.2):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, check=False)
            pytest.fail(f"job {job}: {what} did not happen within {timeout}s: {job_fields(env, job)}")
        time.sleep(poll)
    return value


def test_usr1_saves_requeues_and_resumes_the_same_curve(slurm_cluster, tmp_path):
    ref_env = dict(slurm_cluster, RUN_DIR=str(tmp_path / "ref"))
    _, fields = run_job(ref_env, "--job-name=megaft-test-requeue-ref", f"--output={tmp_path}/ref-%j.out",
                        "slurm/train_srun.sbatch", *ARGS)
    assert fields["ExitCode"] == "0:0", fields

    run = tmp_path / "pre"
    env = dict(slurm_cluster, RUN_DIR=str(run))
    job = submit(env, "--job-name=megaft-test-requeue", f"--output={tmp_path}/pre-%j.out",
                 "slurm/train_srun.sbatch", *ARGS)
    metrics = run / "metrics.jsonl"
    wait_for("3 logged steps", lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 3, job, env)
    # Every task of the job's steps gets USR1 (the batch shell does not), as with --signal=USR1@N.
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)

    def requeued():
        f = job_fields(env, job)
        return f if f["Restarts"] == "1" and f["JobState"] in ("PENDING", "RUNNING", "COMPLETED") else None

    fields = wait_for("the requeue", requeued, job, env)
    if fields["JobState"] == "PENDING":  # skip Slurm's ~2 min hold of requeued jobs
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True, timeout=30)
    fields = wait_for("the end of the requeued job",
                      lambda: (f := job_fields(env, job))["JobState"] in FINISHED and f, job, env)
    out = (tmp_path / f"pre-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", out[-3000:]
    assert fields["Restarts"] == "1", fields
    assert f"requeued Slurm job {job} (restart 1 of at most 1)" in out, out[-3000:]
    got, got_eval = losses(run)
    want, want_eval = losses(tmp_path / "ref")
    assert [s for s, _ in got] == list(range(1, STEPS + 1))  # no step lost or repeated
    assert got == want and got_eval == want_eval  # bitwise: same layout, same ops (CPU, gloo)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(ckpts) == 1 and ckpts[0] != f"step_{STEPS:06d}", ckpts  # only the preemption's save (save_every=0)


def test_past_max_requeue_it_saves_and_ends_without_requeue(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    env = dict(slurm_cluster, RUN_DIR=str(run))
    args = [a.replace("launcher.max_requeue=1", "launcher.max_requeue=0") for a in ARGS]
    job = submit(env, "--job-name=megaft-test-requeue-max", f"--output={tmp_path}/out-%j.out",
                 "slurm/train_srun.sbatch", *args)
    metrics = run / "metrics.jsonl"
    wait_for("2 logged steps", lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 2, job, env)
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
    fields = wait_for("the end of the job", lambda: (f := job_fields(env, job))["JobState"] in FINISHED and f,
                      job, env)
    out = (tmp_path / f"out-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", (fields, out[-3000:])
    assert "launcher.max_requeue=0), so it is NOT requeued again" in out, out[-3000:]
    (ckpt,) = (run / "checkpoints").iterdir()  # it saved before ending
    got, _ = losses(run)
    assert ckpt.name == f"step_{len(got):06d}" and len(got) < STEPS
    assert not (run / "summary.json").exists()  # unfinished runs leave no summary
