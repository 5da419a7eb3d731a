"""megaft-commbench as a Slurm job through megaft's launcher (`-m hydra/launcher=slurm_cpu`) on the
real single-host Slurm: the job's two tasks are two gloo ranks; rank 0 writes the results into
the point's run dir; check mode with an impossible floor fails the job."""
import csv
import json
import os
import subprocess

from .conftest import ROOT
from .test_slurm import final_state

COMMBENCH = os.path.join(ROOT, ".venv", "bin", "megaft-commbench")
SMALL = ["device=cpu", "parallel.tp=2", "commbench.min_bytes=8192", "commbench.max_bytes=65536",
         "commbench.warmup=1", "commbench.repeats=3", "hydra.launcher.timeout_min=5", "hydra.launcher.wait=true"]


def run(env, sweep_dir, *extra):
    cmd = [COMMBENCH, "-m", "hydra/launcher=slurm_cpu", f"hydra.launcher.job_name=megaft-cb-{os.getpid()}",
           f"hydra.sweep.dir={sweep_dir}", *SMALL, *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    (point,) = json.loads((sweep_dir / "submitted.json").read_text())["points"]
    return out, point


def test_commbench_runs_as_a_slurm_job_and_check_mode_fails_it(slurm_cluster, tmp_path):
    out, point = run(slurm_cluster, tmp_path / "ok")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads(open(os.path.join(point["run_dir"], "commbench.json")).read())
    rows = [r for r in doc["results"] if r["scope"] == "intra_node"]
    assert {r["collective"] for r in rows} == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                               "broadcast", "send_recv"}
    assert all(r["correct"] and r["ranks"] == 2 and r["busbw_gbps"] > 0 for r in rows)
    with open(os.path.join(point["run_dir"], "commbench.csv")) as f:  # the table and the plot beside it
        assert len(list(csv.DictReader(f))) == len(doc["results"])
    assert open(os.path.join(point["run_dir"], "commbench.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert final_state(slurm_cluster, point["job_id"]) == "COMPLETED"
    _, bad = run(slurm_cluster, tmp_path / "floor", "commbench.check=true", "commbench.min_busbw_gbps=1000000")
    assert final_state(slurm_cluster, bad["job_id"]) == "FAILED"
    assert os.path.exists(os.path.join(bad["run_dir"], "commbench.json"))  # measured, then refused
