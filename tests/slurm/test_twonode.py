"""megaft on two Slurm nodes on one host (issue 17, part 1): `slurm/cluster.sh up --nodes 2`.

Nodes mn1 and mn2 are slurmd daemons in their own network (and UTS) namespaces on a
bridge, so a job's ranks meet over a real interface (tcp://mn1:port from mn2). Skipped,
with the reason, where the cluster cannot exist (not root, no network namespaces).
"""
import json
import os
import re
import subprocess
import time

import pytest
import torch

from .conftest import CLUSTER_SH, ROOT, _job_env
from .test_slurm import FINISHED, job_fields, run_job

NOT_ROOT, NO_PACKAGES, NO_NETNS = 4, 5, 6
# small_config's model and batch (tests/train_cases.py), as Hydra overrides
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
         "model.max_seq_len=64", "data.task_train_size=2000", "data.task_eval_size=32", "data.seq_len=32",
         "train.micro_batch_size=8", "train.global_batch_size=16", "train.eval_every=10", "optim.warmup_steps=5",
         "train.progress=false", "launcher.max_requeue=0"]
STEPS = 10
TOL = 1e-5  # tp=2 x dp=2 reorders fp32 sums against the single process


@pytest.fixture(scope="module")
def two_nodes():
    """Environment whose SLURM_CONF points at the two-node cluster (started here if needed)."""
    if os.geteuid() != 0:
        pytest.skip(reason="the two-node cluster needs root (network namespaces, root slurmd)")
    status = subprocess.run([CLUSTER_SH, "status", "--nodes", "2"], capture_output=True, text=True, timeout=60)
    started = status.returncode != 0
    if started:
        out = subprocess.run([CLUSTER_SH, "up", "--nodes", "2"], capture_output=True, text=True, timeout=600)
        if out.returncode in (NOT_ROOT, NO_PACKAGES, NO_NETNS):
            pytest.skip(reason=f"slurm/cluster.sh up --nodes 2 cannot run here: {out.stderr.strip()[-500:]}")
        assert out.returncode == 0, f"cluster.sh up --nodes 2 failed:\n{out.stdout}\n{out.stderr}"
    env = dict(_job_env(), SLURM_CONF="/tmp/megaft-slurm2/slurm.conf")
    try:
        yield env
    finally:
        if started:
            subprocess.run([CLUSTER_SH, "down", "--nodes", "2"], capture_output=True, text=True, timeout=120)


def losses(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def hosts_of(run, world):
    return [json.load(open(os.path.join(run, ".health", f"who_{r:05d}.json")))["host"] for r in range(world)]


def single_run(run, steps):
    """The single-process run of the same config, locally."""
    env = {k: v for k, v in _job_env().items() if not k.startswith("SLURM_")}
    out = subprocess.run([os.path.join(ROOT, ".venv", "bin", "megaft-train"), f"hydra.run.dir={run}", *MODEL,
                          f"train.max_steps={steps}", "parallel.tp=1", "launcher.nproc=1"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return run


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return single_run(str(tmp_path_factory.mktemp("single") / "run"), STEPS)


def test_tp2_in_a_node_dp2_across_nodes_equals_the_single_process(two_nodes, single, tmp_path):
    run = str(tmp_path / "run")
    env = dict(two_nodes, RUN_DIR=run)
    job, fields = run_job(env, "--nodes=2", "--ntasks-per-node=2", "--ntasks=4", f"--output={tmp_path}/out-%j",
                          "slurm/train_srun.sbatch", *MODEL, f"train.max_steps={STEPS}", "parallel.tp=2",
                          "launcher.nproc=1", timeout=600)
    out = (tmp_path / f"out-{job}").read_text()
    assert fields["ExitCode"] == "0:0", out[-3000:]
    assert hosts_of(run, 4) == ["mn1", "mn1", "mn2", "mn2"]  # tp pairs inside a node, dp across the bridge
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert (summary["tp"], summary["dp"], summary["world_size"]) == (2, 2, 4)
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(losses(single)), rtol=0, atol=TOL)


# The sigstop test's launcher.timeout_s, with no eval in its run (train.eval_every=1000): at 5 s, with
# the held-out eval's generation at step 10 (the dp ranks' shares finish apart) on the loaded CI
# machine, a collective outlasted it before the stop twice (every rank failed, none was stopped)
SIGSTOP_TIMEOUT_S = 10


def test_sigstopped_rank_on_the_second_node_is_named_and_nothing_is_left(two_nodes, tmp_path):
    """Rank 3 (mn2) is frozen mid-run: the job fails within launcher.timeout_s, rank 0's log names
    rank 3 with its host and coordinates, and no rank process is left on either node."""
    run = str(tmp_path / "run")
    env = dict(two_nodes, RUN_DIR=run)
    # One PID namespace for both nodes: the batch script (on mn1) can stop rank 3's process on mn2
    # by the pid its who_00003.json records.
    who = f"{run}/.health/who_00003.json"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\nset -u\n"
        f"(while n=$(grep -c loss {run}/metrics.jsonl 2>/dev/null); [ ! -f {who} ] || [ \"${{n:-0}}\" -lt 2 ]; do "
        f"sleep 0.2; done; kill -STOP $({ROOT}/.venv/bin/python -c 'import json; print(json.load(open(\"{who}\"))"
        f"[\"pid\"])') && date +%s.%N > {tmp_path}/stopped_at) &\n"
        f"srun --kill-on-bad-exit=1 {ROOT}/.venv/bin/megaft-train hydra.run.dir={run} " + " ".join(MODEL)
        + f" train.max_steps=400 train.eval_every=1000 parallel.tp=2 launcher.timeout_s={SIGSTOP_TIMEOUT_S}\n")
    start = time.monotonic()
    job, fields = run_job(env, "--nodes=2", "--ntasks-per-node=2", "--ntasks=4", f"--output={tmp_path}/out-%j",
                          str(script), timeout=600)
    out = (tmp_path / f"out-{job}").read_text()
    assert fields["JobState"] == "FAILED", out[-3000:]
    assert "megaft: hang report: rank(s) 3 behind" in out, out[-4000:]
    # Slurm's SIGCONT when it ends the step may let rank 3 report too, late: named either way
    assert ("rank 3 on mn2 (pp=0 dp=1 cp=0 tp=1): no report (hung outside a collective, or dead)" in out or
            re.search(r"rank 3 on mn2 \(pp=0 dp=1 cp=0 tp=1\): step \d+, in #\d+ .*, entered after another rank had "
                      r"failed on it \(late\)", out)), out[-4000:]
    # Rank 0's collective failed within launcher.timeout_s of the stop, plus the step it was in
    # (CI slack); its report follows after at most min(timeout_s, 30) s of waiting for markers.
    stopped = float((tmp_path / "stopped_at").read_text())
    failed = json.load(open(os.path.join(run, ".health", "rank_00000.json")))["time"]
    assert 0 < failed - stopped < SIGSTOP_TIMEOUT_S + 15, failed - stopped
    assert time.monotonic() - start < 300
    left = subprocess.run(["pgrep", "-f", f"hydra.run.dir={run}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left behind: {left.stdout}"


def _wait_lines(path, n, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and sum('"loss"' in ln for ln in open(path)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} train lines in {path} after {timeout}s")


def test_lost_node_requeues_on_the_remaining_one_with_dp_halved(two_nodes, tmp_path):
    """Every process of node mn2 is SIGKILLed mid-run (slurmd, slurmstepd, ranks 2 and 3): rank 0 names
    the lost ranks and requeues the elastic job (--nodes=1-2); it comes back on mn1 alone with dp=1,
    resumes the step-4 (or later) checkpoint with accumulation 2 and ends with the single-process curve."""
    # launcher.timeout_s=15: at 5 a tp all-reduce of the restarted job once outlasted it on the loaded
    # 2-core machine (a stall, not a lost rank); the lost node is still named by its missing reports
    steps, run = 30, str(tmp_path / "run")
    want = losses(single_run(str(tmp_path / "single"), steps))
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n"
                      f"srun --kill-on-bad-exit=1 {ROOT}/.venv/bin/megaft-train hydra.run.dir={run} "
                      + " ".join(MODEL) + f" train.max_steps={steps} train.save_every=2 parallel.tp=2 "
                      "launcher.elastic=true launcher.max_requeue=1 launcher.timeout_s=15\n")
    out = subprocess.run(["sbatch", "--parsable", "--time=10", "--nodes=1-2", "--ntasks-per-node=2", "--requeue",
                          "--open-mode=append", f"--output={tmp_path}/out-%j", str(script)], cwd=ROOT,
                         env=two_nodes, capture_output=True, text=True, timeout=60)
    job = out.stdout.strip().split(";")[0]
    assert out.returncode == 0 and job.isdigit(), out
    try:
        _wait_lines(os.path.join(run, "metrics.jsonl"), 6)
        pids = subprocess.run(["ip", "netns", "pids", "megaft-mn2"], capture_output=True, text=True).stdout.split()
        assert pids, "nothing runs on mn2"
        subprocess.run(["kill", "-9", *pids], check=False)  # the node dies
        deadline = time.monotonic() + 400
        while (fields := job_fields(two_nodes, job))["JobState"] not in FINISHED or fields.get("Restarts") == "0":
            assert time.monotonic() < deadline, f"job {job} still {fields['JobState']}"
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], env=two_nodes, check=False)
        subprocess.run([CLUSTER_SH, "up", "--nodes", "2"], capture_output=True, text=True, timeout=300)  # mn2 back
    text = (tmp_path / f"out-{job}").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text[-4000:]
    assert "rank 2 on mn2 (pp=0 dp=1 cp=0 tp=0): no report" in text and \
        "rank 3 on mn2 (pp=0 dp=1 cp=0 tp=1): no report" in text, text[-4000:]
    assert f"megaft: a rank was lost (see the error below); requeued Slurm job {job} (restart 1 of at most 1)" \
        in text, text[-4000:]
    assert f"megaft: job {job} asks for the 1 node(s) that remain (mn1; 2 tasks), without mn2" in text
    assert "this run has 2: tp=2 pp=1 dp=1, gradient accumulation 1 -> 2 micro-batches per rank, global batch " \
        "16 kept" in text, text[-4000:]
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert (summary["dp"], summary["world_size"], summary["restarts"]) == (1, 2, 1)
    assert hosts_of(run, 2) == ["mn1", "mn1"]
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(want), rtol=0, atol=TOL)


def test_commbench_across_the_two_nodes_measures_the_bridge_and_feeds_the_planner(two_nodes, tmp_path):
    """megaft-commbench under srun on 2 nodes x 2 tasks, tp=2 (issue 19, part 4): tp groups stay
    in a node (= intra_node), dp groups and inter_node cross the bridge, the node-pair matrix
    holds both directions between mn1 and mn2, every result is correct with nccl-tests'
    arithmetic, and megaft-plan's cluster.measured takes both tiers from it."""
    from megaft.config import compose_config
    from megaft.plan.shape import planning_config

    run = str(tmp_path / "cb")
    script = tmp_path / "cb.sh"
    script.write_text(
        "#!/bin/bash\nset -u\n"
        f"srun --kill-on-bad-exit=1 {ROOT}/.venv/bin/megaft-commbench hydra.run.dir={run} device=cpu parallel.tp=2 "
        "commbench.min_bytes=8192 commbench.max_bytes=262144 commbench.warmup=1 commbench.repeats=3 "
        "commbench.pair_bytes=262144 commbench.plot=false\n")
    job, fields = run_job(dict(two_nodes, RUN_DIR=run), "--nodes=2", "--ntasks-per-node=2", "--ntasks=4",
                          f"--output={tmp_path}/out-%j", str(script), timeout=600)
    out = (tmp_path / f"out-{job}").read_text()
    assert fields["ExitCode"] == "0:0" and "megaft-commbench: PASS" in out, out[-3000:]
    doc = json.load(open(os.path.join(run, "commbench.json")))
    assert doc["hosts"] == {"mn1": [0, 1], "mn2": [2, 3]} and doc["grid"]["tp"] == 2 and doc["grid"]["dp"] == 2
    scopes = {s["name"]: s for s in doc["scopes"]}
    assert (scopes["intra_node"]["groups"], scopes["inter_node"]["groups"]) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert (scopes["intra_node"]["spans"], scopes["inter_node"]["spans"]) == ("within a node", "across nodes")
    assert (scopes["tp"]["same_as"], scopes["dp"]["same_as"]) == ("intra_node", "inter_node")
    # nccl-tests' bus factors at n=2: all-reduce 2(n-1)/n, reduce-scatter/all-gather/all-to-all (n-1)/n
    factor = {"all_reduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5, "all_to_all": 0.5, "broadcast": 1.0,
              "send_recv": 1.0}
    assert {r["scope"] for r in doc["results"]} == {"intra_node", "inter_node"}
    for r in doc["results"]:
        assert r["correct"] and r["ranks"] == 2 and r["busbw_gbps"] > 0, r
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor[r["collective"]]), r
    assert {(m["src"], m["dst"]) for m in doc["pairs"]["matrix"]} == {("mn1", "mn2"), ("mn2", "mn1")}
    assert all(m["gbps"] > 0 for m in doc["pairs"]["matrix"])
    # megaft-plan cluster.measured=<this run>: NVLink's place from intra_node, InfiniBand's from inter_node
    cfg = compose_config(["cluster=cpu", "cluster.nodes=2", f"cluster.measured={run}"])
    shaped, problems = planning_config(cfg)
    assert problems == []
    for scope, key in (("intra_node", "nvlink_gbps"), ("inter_node", "ib_gbps")):
        largest = max((r for r in doc["results"] if r["scope"] == scope and r["collective"] == "all_reduce"),
                      key=lambda r: r["bytes"])
        assert getattr(shaped.cluster, key) * shaped.cluster.comm_fraction == pytest.approx(largest["busbw_gbps"])
