"""`megaft-plan ... plan.probe=3` on the real single-host Slurm: the top three layouts of a
tiny model on the cpu cluster (2 gloo ranks) run as ONE job array through megaft's launcher
(hydra/launcher=slurm_cpu), their summaries are read back, and the layouts re-ranked by the
measured tokens/s per GPU, with the model's error per term in plan.json and on stdout."""
import json
import os
import subprocess
import sys
import time

import yaml

from megaft.launch.submit_record import SUBMITTED_FILE
from megaft.plan.multirun import run_multirun

from .conftest import ROOT
from .test_slurm import final_state, job_fields

PLAN = os.path.join(ROOT, ".venv", "bin", "megaft-plan")
STEPS = 4


def test_probe_3_submits_one_array_collects_three_summaries_and_reranks(slurm_cluster, tmp_path):
    run_dir = tmp_path / "plan"
    cmd = [PLAN, "cluster=cpu", "model=tiny", "device=cpu", "data.seq_len=32", "train.global_batch_size=8",
           "data.task_train_size=500", "data.task_eval_size=16", "train.max_steps=250", "plan.top_k=5",
           "model.recompute=full",  # a layout key given on the command line: each probe runs its layout's
           "plan.probe=3", f"plan.probe_steps={STEPS}", "plan.probe_timeout_min=4", f"hydra.run.dir={run_dir}",
           "hydra/launcher=slurm_cpu", "hydra.launcher.timeout_min=5",
           f"hydra.launcher.job_name=megaft-probe-{os.getpid()}"]
    out = subprocess.run(cmd, cwd=ROOT, env=slurm_cluster, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    probe = plan["probe"]

    # One array of three 2-rank jobs, in the planned order.
    record = json.loads((run_dir / "probe" / "submitted.json").read_text())
    assert [(a["shape"]["world_size"], a["points"]) for a in record["arrays"]] == [(2, [0, 1, 2])]
    (array,) = probe["array_job_ids"]
    assert array == record["arrays"][0]["array_job_id"]
    for task, run in enumerate(probe["runs"]):
        assert run["job_id"] == f"{array}_{task}"
        fields = job_fields(slurm_cluster, run["job_id"])
        assert (fields["ArrayJobId"], fields["ArrayTaskId"], fields["NumTasks"]) == (array, str(task), "2")
        assert final_state(slurm_cluster, run["job_id"]) == "COMPLETED"

    # Three summaries, each from the layout it was given, with the probe's step count and no checkpoints.
    assert [r["status"] for r in probe["runs"]] == ["measured"] * 3
    for run, layout in zip(probe["runs"], plan["layouts"]):
        assert run["plan_rank"] == layout["rank"] and run["overrides"] == layout["overrides"][-len(run["overrides"]):]
        summary = json.loads(open(os.path.join(run["run_dir"], "summary.json")).read())
        assert (summary["world_size"], summary["steps"]) == (2, STEPS)
        assert (summary["tp"], summary["pp"], summary["dp"], summary["zero"]) == \
            (layout["tp"], layout["pp"], layout["dp"], layout["zero"])
        assert not os.path.exists(os.path.join(run["run_dir"], "checkpoints"))
        ran = yaml.safe_load(open(os.path.join(run["run_dir"], ".hydra", "config.yaml")))
        assert (ran["model"]["recompute"], ran["train"]["micro_batch_size"], ran["train"]["max_steps"]) == \
            (layout["recompute"], layout["micro_batch_size"], STEPS)
        meas = run["measured"]
        assert meas["steady_steps"] == STEPS - 1 and meas["tokens_per_s_per_gpu"] > 0
        assert abs(meas["tokens_per_s"] / 2 - meas["tokens_per_s_per_gpu"]) < 1e-6 * meas["tokens_per_s"]
        assert layout["measured"] == meas
        step = run["errors"]["step"]
        assert step["predicted_s"] == layout["step_s"] and step["measured_s"] == meas["step_s"] > 0
        assert abs(step["ratio"] - layout["step_s"] / meas["step_s"]) < 1e-9
        assert {"forward+backward", "optimizer", "exposed comm"} <= set(run["errors"])

    # Re-ranked by measured throughput: a permutation of the planned ranks, fastest first.
    assert sorted(probe["ranking"]) == [1, 2, 3]
    by_rank = {r["plan_rank"]: r["measured"]["tokens_per_s_per_gpu"] for r in probe["runs"]}
    speeds = [by_rank[r] for r in probe["ranking"]]
    assert speeds == sorted(speeds, reverse=True)
    table = out.stdout.split("re-ranked by measured tokens/s per GPU:\n")[1].splitlines()
    assert [int(line.split()[1]) for line in table[1:4]] == probe["ranking"]
    assert "model error per term" in out.stdout and "exposed comm" in out.stdout


def test_probe_timeout_cancels_the_arrays_it_submitted(slurm_cluster, tmp_path, monkeypatch):
    """plan.probe_timeout_min: when the multirun outlives it, the arrays the sweep recorded are
    scancel'ed (no probe job keeps its nodes) and the status is -1 (megaft-plan then reports
    every layout unmeasured)."""
    for key, value in slurm_cluster.items():
        monkeypatch.setenv(key, value)  # run_multirun's scancel talks to this Slurm
    out = subprocess.run(["sbatch", "--parsable", "--time=5", "--array=0-1", f"--output={tmp_path}/%A_%a.out",
                          "--wrap", "sleep 300"], env=slurm_cluster, capture_output=True, text=True, timeout=60)
    array = out.stdout.strip().split(";")[0]
    assert out.returncode == 0 and array.isdigit(), out.stderr
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / SUBMITTED_FILE).write_text(json.dumps({"points": [], "arrays": [{"array_job_id": array}]}))
    started = time.monotonic()
    status, tail = run_multirun([sys.executable, "-c", "import time; print('submitted, waiting', flush=True); "
                                 "time.sleep(120)"], str(sweep), timeout_s=3)
    assert status == -1 and "submitted, waiting" in tail and time.monotonic() - started < 60
    for task in (0, 1):
        assert final_state(slurm_cluster, f"{array}_{task}", timeout=60) == "CANCELLED"
