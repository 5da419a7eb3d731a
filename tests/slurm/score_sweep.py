"""A 2-point sweep whose points share one scoring job (pref.scores, distill.scores), on the real Slurm:
submitted, checked to queue one scoring job that both training jobs wait for (--dependency=afterok),
and waited for until all three completed, the training jobs starting after the scoring job ended."""
import json
import os
import subprocess
import time

import pytest

from .conftest import ROOT
from .test_slurm import job_fields
from .test_sweep import TRAIN, queued

WAIT_S = 420


def run_scored_sweep(env: dict, sweep, *overrides: str) -> tuple[list[dict], dict]:
    """(the sweep's points from submitted.json, the scoring job's scontrol fields) once every job completed."""
    out = subprocess.run([TRAIN, "-m", "hydra/launcher=slurm_cpu", f"hydra.launcher.job_name=megaft-test-{os.getpid()}",
                          f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=5", "device=cpu", "parallel.tp=1",
                          "data.seq_len=16", "train.max_steps=2", "train.progress=false", "train.global_batch_size=4",
                          "train.micro_batch_size=2", "train.eval_every=1000", *overrides],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    points = json.loads((sweep / "submitted.json").read_text())["points"]
    assert [p["status"] for p in points] == ["submitted", "submitted"]
    [score] = {p["score_job_id"] for p in points}  # one scoring job for the shared fingerprint
    trains = [p["job_id"] for p in points]
    for job in trains:
        assert job_fields(env, job)["Dependency"] in (f"afterok:{score}(unfulfilled)", "(null)")
    deadline = time.monotonic() + WAIT_S
    while queued(env, [score, *trains]):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", score, *{j.split("_")[0] for j in trains}], env=env, check=False)
            pytest.fail(f"jobs {score} {trains} still queued after {WAIT_S} s (cancelled)")
        time.sleep(1)
    scored = job_fields(env, score)
    assert scored["JobState"] == "COMPLETED", scored
    for job in trains:
        trained = job_fields(env, job)
        assert trained["JobState"] == "COMPLETED" and trained["StartTime"] >= scored["EndTime"], (trained, scored)
    return points, scored
