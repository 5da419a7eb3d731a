"""megaft-verify as a Slurm job through megaft's launcher (`-m hydra/launcher=slurm_cpu`) on the
real single-host Slurm: each Slurm task is one rank of the layout (tp=2 here), rank 0 runs the
single-process reference and writes verify.json in the point's run dir; the job completes."""
import json
import os
import subprocess

from .conftest import ROOT
from .test_slurm import final_state

VERIFY = os.path.join(ROOT, ".venv", "bin", "megaft-verify")
TINY = ["device=cpu", "model.dim=32", "model.n_layers=2", "model.ffn_dim=64", "data.task_train_size=300",
        "data.task_eval_size=8", "data.seq_len=32", "train.micro_batch_size=4", "train.global_batch_size=8",
        "verify.steps=2", "hydra.launcher.timeout_min=5", "hydra.launcher.wait=true"]


def test_verify_runs_as_a_slurm_job(slurm_cluster, tmp_path):
    name = f"hydra.launcher.job_name=megaft-verify-{os.getpid()}"
    out = subprocess.run([VERIFY, "-m", "hydra/launcher=slurm_cpu", name,
                          f"hydra.sweep.dir={tmp_path}", *TINY, "parallel.tp=2", "parallel.sequence_parallel=true"],
                         cwd=ROOT, env=slurm_cluster, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads((tmp_path / "submitted.json").read_text())
    (point,) = record["points"]
    assert point["status"] == "submitted"
    report = json.loads(open(os.path.join(point["run_dir"], "verify.json")).read())
    assert report["passed"] is True and [s["step"] for s in report["steps"]] == [1, 2]
    assert all(s["loss_rel"] <= 1e-5 for s in report["steps"])
    slurm = json.loads(open(os.path.join(point["run_dir"], "slurm.json")).read())
    assert slurm["world_size"] == 2  # two Slurm tasks, one rank each
    assert final_state(slurm_cluster, point["job_id"]) == "COMPLETED"
