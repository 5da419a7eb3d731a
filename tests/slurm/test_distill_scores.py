"""distill.scores under the Slurm launcher on the real single-host Slurm: a 2-point distillation sweep
over distill.beta with a stored top-k teacher (distill.top_k) queues one scoring job, both training
jobs wait for it (--dependency=afterok) and train on the file it stored, which neither rewrites."""
import glob
import json
import os
import subprocess
import sys
import time

import pytest

from .conftest import ROOT
from .test_slurm import job_fields
from .test_sweep import TRAIN, queued

sys.path.insert(0, os.path.join(ROOT, "tests"))
from distill.distill_cases import write_sft  # noqa: E402
from models.hf_fixture import make_hf_llama  # noqa: E402


def test_a_sweep_scores_its_teacher_once(slurm_cluster, tmp_path):
    env = slurm_cluster
    ckpt, teacher, data = tmp_path / "ckpt", tmp_path / "teacher", tmp_path / "sft.jsonl"
    store, sweep = tmp_path / "scores", tmp_path / "sweep"
    make_hf_llama(str(ckpt), seed=1)
    make_hf_llama(str(teacher), seed=2)
    write_sft(str(data))
    out = subprocess.run([TRAIN, "-m", "hydra/launcher=slurm_cpu", f"hydra.launcher.job_name=megaft-test-{os.getpid()}",
                          f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=5", "device=cpu", "parallel.tp=1",
                          f"model.init_from={ckpt}", f"data.path={data}", "data.seq_len=16", "data.packing=none",
                          "train.objective=distill", f"distill.teacher={teacher}", "distill.loss=jsd",
                          "distill.beta=0.3,0.7", "distill.top_k=8", f"distill.scores={store}", "train.max_steps=2",
                          "train.progress=false", "train.global_batch_size=4", "train.micro_batch_size=2",
                          "train.eval_every=1000"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    points = json.loads((sweep / "submitted.json").read_text())["points"]
    assert [p["status"] for p in points] == ["submitted", "submitted"]
    [score] = {p["score_job_id"] for p in points}  # one scoring job for the shared teacher
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
    [stored] = glob.glob(str(store / "teacher-topk-*.safetensors"))
    # written by the scoring job, before it ended; a training run that scored again would have replaced it
    # (os.replace) after loading torch, the models and the data, seconds after its own start
    ended = time.mktime(time.strptime(scored["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    assert os.stat(stored).st_mtime <= ended + 0.999, (os.stat(stored).st_mtime, scored["EndTime"])
    for point in points:
        rows = [json.loads(line) for line in open(os.path.join(point["run_dir"], "metrics.jsonl"))]
        assert len([r for r in rows if "loss" in r]) == 2, point
