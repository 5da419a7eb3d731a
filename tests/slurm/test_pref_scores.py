"""pref.scores under the Slurm launcher on the real single-host Slurm: a 2-point DPO sweep
over beta shares one reference fingerprint, so one scoring job stores the reference
log-probs and both training jobs wait for it (--dependency=afterok) and read them."""
import glob
import json
import os
import subprocess
import sys
import time

import pytest

from megaft.training.summary import RunSummary

from .conftest import ROOT
from .test_slurm import job_fields
from .test_sweep import TRAIN, queued

sys.path.insert(0, os.path.join(ROOT, "tests"))
from models.hf_fixture import make_hf_llama  # noqa: E402
from pref.pref_train_cases import write_pairs  # noqa: E402


def test_a_sweep_scores_its_reference_once(slurm_cluster, tmp_path):
    env = slurm_cluster
    ckpt, pairs, store, sweep = tmp_path / "ckpt", tmp_path / "pairs.jsonl", tmp_path / "scores", tmp_path / "sweep"
    make_hf_llama(str(ckpt), seed=1)
    write_pairs(str(pairs))
    out = subprocess.run([TRAIN, "-m", "hydra/launcher=slurm_cpu", f"hydra.launcher.job_name=megaft-test-{os.getpid()}",
                          f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=5", "device=cpu", "parallel.tp=1",
                          f"model.init_from={ckpt}", f"data.path={pairs}", "data.seq_len=16", "train.objective=dpo",
                          "pref.beta=0.1,0.5", f"pref.scores={store}", "train.max_steps=2", "train.progress=false",
                          "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=1000"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    points = json.loads((sweep / "submitted.json").read_text())["points"]
    assert [p["status"] for p in points] == ["submitted", "submitted"]
    [score] = {p["score_job_id"] for p in points}  # one scoring job for the shared fingerprint
    trains = [p["job_id"] for p in points]
    for job in trains:
        assert job_fields(env, job)["Dependency"] in (f"afterok:{score}(unfulfilled)", "(null)")
    deadline = time.monotonic() + 420
    while queued(env, [score, *trains]):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", score, *{j.split("_")[0] for j in trains}], env=env, check=False)
            pytest.fail(f"jobs {score} {trains} still queued after 420 s (cancelled)")
        time.sleep(1)
    scored = job_fields(env, score)
    assert scored["JobState"] == "COMPLETED", scored
    for job in trains:
        trained = job_fields(env, job)
        assert trained["JobState"] == "COMPLETED" and trained["StartTime"] >= scored["EndTime"], (trained, scored)
    assert len(glob.glob(str(store / "reference-*.safetensors"))) == 1
    for point in points:  # each run read the stored scores: no scoring time of its own
        summary = RunSummary.read(point["run_dir"])
        assert summary is not None and summary.steps == 2 and summary.reference_s is None, point
    report = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "megaft.report", str(sweep),
                             "--no-plot"], env=env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert len(json.loads((sweep / "report.json").read_text())) == 2  # the scoring run is not a point
