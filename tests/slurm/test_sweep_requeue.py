"""Preemption of sweep jobs: points submitted by megaft's Slurm launcher (submitit) get a
warning signal mid-run, save, requeue themselves and finish with the uninterrupted curve.

One array of three 2-rank points that train identically (they differ only in
launcher.max_requeue=1,2,3, which changes no number): #0 gets SIGUSR2, the signal submitit
asks Slurm for and would handle itself, after 3 logged steps; #1 gets SIGUSR1, the presets'
`--signal=USR1@N`, during start-up, while the task still imports torch (its interpreter
blocks both from its first line, megaft.launch.submit.task_python, so the signal waits for
megaft's handlers and the run stops at its first step boundary instead of being killed);
#2 is the uninterrupted reference. The signal goes to the array task's step,
`scancel --signal=... <array>_<task>.0` (submitit's srun is step 0), as `--signal=SIG@N`
does: on Slurm 22.05 `scancel --signal <array>_<task>` while other tasks of the array are
pending signals the task but then fails ("Job can not be altered now, try again later")
and retries, sending the signal again every few seconds, to the requeued attempt too.
megaft's handlers replace submitit's (megaft.launch.submit_task): every rank saves, rank 0
runs `scontrol requeue`, the attempt ends without a result, and the requeued attempt re-runs
the pickled task, which resumes from the checkpoint. Slurm holds a requeued job for the
credential lifetime (~15 s, slurm/cluster.sh); the node's 2 CPUs run the other points meanwhile.
"""
import json
import os
import subprocess
import time

import submitit

from .conftest import ROOT
from .test_requeue import losses, wait_for
from .test_slurm import FINISHED, ctld_log, job_fields
from .test_sweep import TINY, TRAIN

STEPS = 40
ARGS = [a for a in TINY if not a.startswith("train.max_steps")] + [
    f"train.max_steps={STEPS}", "train.eval_every=10", "model.n_layers=2", "parallel.tp=2"]
SIGNALS = ("USR2", "USR1")  # for points #0 (mid-run) and #1 (during start-up)


def rank0_log(point):
    return os.path.join(point["submitit_folder"], f"{point['job_id']}_0_log.out")


def test_signalled_sweep_points_requeue_and_resume_the_same_curve(slurm_cluster, tmp_path):
    env, sweep = slurm_cluster, tmp_path / "sweep"
    started = time.monotonic()
    out = subprocess.run([TRAIN, "-m", "hydra/launcher=slurm_cpu", f"hydra.launcher.job_name=megaft-test-{os.getpid()}",
                          f"hydra.sweep.dir={sweep}", *ARGS, "launcher.max_requeue=1,2,3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((sweep / "submitted.json").read_text())
    (array,) = [a["array_job_id"] for a in record["arrays"]]
    *points, reference = record["points"]
    try:
        check_points(env, sweep, array, points, reference)
    finally:  # a failed check leaves nothing queued (a no-op once all ended)
        subprocess.run(["scancel", array], env=env, capture_output=True, check=False, timeout=30)
    print(f"sweep requeue test: {time.monotonic() - started:.0f}s")


def check_points(env, sweep, array, points, reference):
    """Signal each of `points` mid-run, then check every point's end against `reference`."""
    for point, sig in zip(points, SIGNALS):  # the array's tasks start in order on the 2 CPUs
        metrics, log = sweep / str(point["num"]) / "metrics.jsonl", rank0_log(point)
        if sig == "USR2":
            wait_for(f"3 logged steps of {point['job_id']}",
                     lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 3, point["job_id"], env)
        else:  # submitit logs this before it unpickles the task, which imports megaft and torch
            wait_for(f"the start of {point['job_id']}",
                     lambda: os.path.exists(log) and "Loading pickle" in open(log).read(), point["job_id"], env,
                     poll=0.05)
        subprocess.run(["scancel", f"--signal={sig}", f"{point['job_id']}.0"], env=env, check=True, timeout=30)
        assert sig == "USR2" or not metrics.exists(), "the USR1 came after the start-up it is meant to test"
        wait_for(f"the requeue of {point['job_id']}", lambda: job_fields(env, point["job_id"])["Restarts"] == "1",
                 point["job_id"], env)

    def ended(job, restarts):
        f = job_fields(env, job)
        return f if f["JobState"] in FINISHED and f["Restarts"] == restarts else None

    ref = wait_for("the end of the reference", lambda: ended(reference["job_id"], "0"), reference["job_id"], env,
                   timeout=300)
    assert ref["JobState"] == "COMPLETED", ref
    want, want_eval = losses(sweep / str(reference["num"]))
    for point, sig in zip(points, SIGNALS):
        fields = wait_for(f"the end of {point['job_id']}", lambda: ended(point["job_id"], "1"), point["job_id"], env,
                          timeout=300)
        log = rank0_log(point)  # rank 0's stdout
        text = open(log).read() if os.path.exists(log) else f"(no {log})"
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (sig, text[-3000:],
                                                                                  ctld_log(env, fields["JobId"]))
        max_requeue = point["num"] + 1
        assert f"requeued Slurm job {fields['JobId']} (restart 1 of at most {max_requeue})" in text, text[-3000:]
        # megaft's handler did it (submitit's would log "Caught signal"), and only the resumed attempt
        # ended with a result (the interrupted one exited without, so it never counted as done).
        assert "Caught signal" not in text and text.count("Job completed successfully") == 1, text[-3000:]
        run = sweep / str(point["num"])
        got, got_eval = losses(run)
        assert [s for s, _ in got] == list(range(1, STEPS + 1)), sig  # no step lost or repeated
        assert got == want and got_eval == want_eval, sig  # bitwise: same config, same ops (CPU, gloo)
        # the signal's save and the final step's (save_every=0)
        ckpt, final = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert 0 < int(ckpt.split("_")[1]) < STEPS and final == f"step_{STEPS:06d}", (sig, ckpt)
        # The interrupted attempt left no result: the one submitit holds is the finished run's.
        status, summary = submitit.core.utils.pickle_load(
            os.path.join(point["submitit_folder"], f"{point['job_id']}_0_result.pkl"))
        assert status == "success" and summary["steps"] == STEPS and "requeue" not in summary, (sig, summary)

    report = subprocess.run([os.path.join(ROOT, ".venv", "bin", "megaft-report"), "--no-plot", str(sweep)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    rows = json.loads((sweep / "report.json").read_text())
    assert [r["status"] for r in rows] == ["done"] * 3, report.stdout
