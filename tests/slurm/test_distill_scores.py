"""distill.scores under the Slurm launcher on the real single-host Slurm: a 2-point distillation sweep
over distill.beta with a stored top-k teacher (distill.top_k) queues one scoring job, both training
jobs wait for it (--dependency=afterok) and train on the file it stored, which neither rewrites."""
import glob
import json
import os
import sys
import time

from .conftest import ROOT
from .score_sweep import run_scored_sweep

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
    points, scored = run_scored_sweep(env, sweep, f"model.init_from={ckpt}", f"data.path={data}", "data.packing=none",
                                      "train.objective=distill", f"distill.teacher={teacher}", "distill.loss=jsd",
                                      "distill.beta=0.3,0.7", "distill.top_k=8", f"distill.scores={store}")
    [stored] = glob.glob(str(store / "teacher-topk-*.safetensors"))
    # written by the scoring job, before it ended; a training run that scored again would have replaced it
    # (os.replace) after loading torch, the models and the data, seconds after its own start
    ended = time.mktime(time.strptime(scored["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    assert os.stat(stored).st_mtime <= ended + 0.999, (os.stat(stored).st_mtime, scored["EndTime"])
    for point in points:
        rows = [json.loads(line) for line in open(os.path.join(point["run_dir"], "metrics.jsonl"))]
        assert len([r for r in rows if "loss" in r]) == 2, point
