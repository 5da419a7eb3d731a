"""pref.scores under the Slurm launcher on the real single-host Slurm: a 2-point DPO sweep
over beta shares one reference fingerprint, so one scoring job stores the reference
log-probs and both training jobs wait for it (--dependency=afterok) and read them."""
import glob
import json
import os
import subprocess
import sys

from megaft.training.summary import RunSummary

from .conftest import ROOT
from .score_sweep import run_scored_sweep

sys.path.insert(0, os.path.join(ROOT, "tests"))
from models.hf_fixture import make_hf_llama  # noqa: E402
from pref.pref_train_cases import write_pairs  # noqa: E402


def test_a_sweep_scores_its_reference_once(slurm_cluster, tmp_path):
    env = slurm_cluster
    ckpt, pairs, store, sweep = tmp_path / "ckpt", tmp_path / "pairs.jsonl", tmp_path / "scores", tmp_path / "sweep"
    make_hf_llama(str(ckpt), seed=1)
    write_pairs(str(pairs))
    points, _ = run_scored_sweep(env, sweep, f"model.init_from={ckpt}", f"data.path={pairs}",
                                 "train.objective=dpo", "pref.beta=0.1,0.5", f"pref.scores={store}")
    assert len(glob.glob(str(store / "reference-*.safetensors"))) == 1
    for point in points:  # each run read the stored scores: no scoring time of its own
        summary = RunSummary.read(point["run_dir"])
        assert summary is not None and summary.steps == 2 and summary.reference_s is None, point
    report = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "megaft.report", str(sweep),
                             "--no-plot"], env=env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert len(json.loads((sweep / "report.json").read_text())) == 2  # the scoring run is not a point
