"""Issue 17, part 2 (elastic restart) and part 4 (stragglers), on the local launcher.

- a crashed rank set is restarted (launcher.max_restarts) and continues the curve;
- a dp=2 checkpoint resumed on 1 rank with launcher.elastic=true keeps the global
  batch (accumulation 1 -> 2) and the uninterrupted curve, and a 1-rank checkpoint grows
  to dp=2 (accumulation 2 -> 1) the same way;
- a world that tp*pp no longer divides is re-planned by the planner (cluster named), else refused;
- a rank slowed on purpose is named by the straggler warning.
Each run is 2 gloo ranks at dp=2 of small_config (20 steps, global batch 16, micro 8).
"""
import json
import os
import socket
import subprocess

import pytest
import torch
from train_cases import read_rows, small_config

from launch.faults import FAULT_STEP, SLOW_S, die_once_worker, signal_worker, slow_worker
from megaft.config import ConfigError
from megaft.config.launcher import LauncherConfig, check_launcher
from megaft.config.train import TrainConfig, check_train
from megaft.launch.elastic import ElasticError, adapt
from megaft.launch.local import launch_local
from megaft.launch.rank import RunStoppedError
from megaft.train import run as train_run
from megaft.training.run_config import read_run_config

TOL = 1e-5  # another dp reorders fp32 gradient sums (docs/checkpoints-and-elastic.md: 1e-6); same layout is bitwise


def config(**launcher):
    cfg = small_config()
    cfg.launcher.nproc, cfg.launcher.max_requeue = 2, 0
    for k, v in launcher.items():
        setattr(cfg.launcher, k, v)
    return cfg


def losses(run):
    return [r["loss"] for r in read_rows(run) if "loss" in r]


pytestmark = pytest.mark.usefixtures("not_in_slurm")  # tests/launch/conftest.py


def test_crashed_rank_set_restarts_and_continues_the_curve(straight, tmp_path, capfd):
    run = str(tmp_path)
    cfg = config(max_restarts=1)
    cfg.train.save_every = 2
    launch_local(cfg, run, worker=die_once_worker)  # rank 1 SIGKILLed in step FAULT_STEP of the first attempt
    out = capfd.readouterr().out
    assert "megaft: rank 1 of 2 was killed by SIGKILL" in out, out[-3000:]
    assert "restarting the 2 rank(s), restart 1 of at most 1 (launcher.max_restarts)" in out, out[-3000:]
    assert [r["step"] for r in read_rows(run) if "loss" in r] == list(range(1, 21))  # trimmed, no duplicates
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(losses(straight)), rtol=0, atol=TOL)
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["restarts"] == 1 and summary["steps"] == 20
    assert json.load(open(os.path.join(straight, "summary.json")))["restarts"] == 0


def elastic_resume(run: str, capfd, *, saved: int, was: int, now: int) -> dict:
    """Resume `run` (its step-`saved` checkpoint written at dp=`was`) on `now` ranks with
    launcher.elastic=true; checks the restart message, returns summary.json."""
    cfg = config(elastic=True, nproc=now)
    cfg.parallel.dp = was  # as the job was configured: elastic lets dp follow the ranks it got
    train_run(cfg, run)
    out = capfd.readouterr().out
    acc = {dp: 16 // (8 * dp) for dp in (was, now)}  # global batch 16, micro-batch 8
    assert (f"megaft: elastic restart: checkpoint step {saved} was written by {was} rank(s) (tp=1 pp=1 dp={was}); "
            f"this run has {now}: tp=1 pp=1 dp={now}, gradient accumulation {acc[was]} -> {acc[now]} micro-batches "
            "per rank, global batch 16 kept; the checkpoint is resharded") in out, out[-3000:]
    return json.load(open(os.path.join(run, "summary.json")))


def ran_layout(run: str) -> tuple[int, int, int]:
    """(world size, dp, gradient accumulation) of RUN_DIR/config.yaml: the latest attempt's."""
    ran = read_run_config(run)
    return ran.world_size, ran.config.parallel.dp, ran.accumulation_steps


def test_dp2_checkpoint_resumes_on_one_rank_with_the_same_global_batch(straight, tmp_path, capfd):
    run = str(tmp_path)
    with pytest.raises(RunStoppedError):  # both ranks save at step FAULT_STEP + 1 and stop
        launch_local(config(), run, worker=signal_worker)
    assert ran_layout(run) == (2, 2, 1)  # global batch 16 = 2 ranks x 1 micro-batch of 8
    saved = FAULT_STEP + 1
    summary = elastic_resume(run, capfd, saved=saved, was=2, now=1)
    assert (summary["dp"], summary["world_size"], summary["restarts"]) == (1, 1, 0)
    assert ran_layout(run) == (1, 1, 2)  # config.yaml after the shrink: dp=1, 2 micro-batches per step
    got, want = losses(run), losses(straight)
    assert got[:saved] == want[:saved]  # written by the dp=2 ranks before the stop
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=TOL)


def test_one_rank_checkpoint_grows_to_dp2_with_the_same_global_batch(straight, tmp_path, capfd):
    """The reverse: a run checkpointed by 1 rank (dp=1, accumulation 2) comes back on 2 ranks
    with launcher.elastic=true: dp grows to 2, accumulation 2 -> 1, the curve goes on."""
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer

    run, saved = str(tmp_path), FAULT_STEP + 1
    one = config(nproc=1)
    one.parallel.dp, one.train.save_every = 1, saved
    Trainer(one, ParallelGrid.single(), run).fit(stop_after=saved)  # saves step `saved`, then stops
    assert [r["step"] for r in read_rows(run) if "loss" in r] == list(range(1, saved + 1))
    assert ran_layout(run) == (1, 1, 2)
    summary = elastic_resume(run, capfd, saved=saved, was=1, now=2)
    assert (summary["dp"], summary["world_size"], summary["steps"]) == (2, 2, 20)
    assert ran_layout(run) == (2, 2, 1)  # config.yaml after the growth
    got, want = losses(run), losses(straight)
    assert len(got) == len(want) == 20
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=TOL)


def test_elastic_refuses_a_world_that_tp_pp_do_not_divide(tmp_path):
    cfg = config(elastic=True, nproc=3)
    cfg.parallel.tp = 2
    with pytest.raises(ElasticError) as info:
        adapt(cfg, 3, str(tmp_path))
    assert str(info.value).startswith("launcher.elastic: this run got 3 rank(s), which parallel.tp*parallel.pp*"
                                      "parallel.cp = 2*1*1 = 2 does not divide, so no dp fits; fix: start a "
                                      "multiple of 2 ranks")
    with pytest.raises(ConfigError, match="this run got 3 rank.*or name a cluster .cluster=<preset>"):
        train_run(cfg, str(tmp_path))  # no cluster named: no planner to re-plan with
    assert adapt(config(), 4, str(tmp_path)) is None  # not elastic: nothing changes


def cpu_cluster():
    """conf/cluster/cpu.yaml as a ClusterConfig (what `cluster=cpu` on the command line gives)."""
    import yaml

    from megaft.config.cluster import ClusterConfig

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "conf", "cluster", "cpu.yaml")) as f:
        preset = yaml.safe_load(f)
    preset.pop("defaults", None)
    return ClusterConfig(**preset)


def test_world_that_tp_does_not_divide_is_replanned_when_a_cluster_is_named(straight, tmp_path, capfd):
    """A tp=2 checkpoint restarted on 1 rank: tp=2 cannot be kept, the planner (cluster=cpu) picks
    tp=1 dp=1, the checkpoint reshards and the curve goes on (global batch 16 kept)."""
    run = str(tmp_path)
    cfg = config()
    cfg.parallel.tp = 2
    with pytest.raises(RunStoppedError):  # both ranks save at step FAULT_STEP + 1 and stop
        launch_local(cfg, run, worker=signal_worker)
    cfg = config(elastic=True, nproc=1)
    cfg.parallel.tp, cfg.cluster = 2, cpu_cluster()
    train_run(cfg, run)
    out = capfd.readouterr().out
    assert ("megaft: elastic restart re-planned: this run got 1 rank(s), which parallel.tp*parallel.pp*parallel.cp "
            "= 2*1*1 = 2 does not divide, so no dp fits; the planner (cluster=cpu, 1 x 1 ranks) chose tp=1 cp=1 "
            "pp=1 vpp=1 dp=1 zero=0 ") in out, out[-3000:]
    assert "global batch 16 kept; the checkpoint is resharded" in out
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert (summary["tp"], summary["dp"], summary["world_size"]) == (1, 1, 1)
    ran = read_run_config(run)  # config.yaml: the re-planned layout, not the tp=2 one asked for
    assert (ran.config.parallel.tp, ran.config.parallel.dp, ran.world_size) == (1, 1, 1)
    assert ran.accumulation_steps == 16 // ran.config.train.micro_batch_size
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(losses(straight)), rtol=0, atol=TOL)


def test_robustness_config_checks():
    assert check_launcher(LauncherConfig(max_restarts=2, elastic=True, min_nodes=1, nodes=2)) == []
    problems = check_launcher(LauncherConfig(max_restarts=-1, min_nodes=3, nodes=2))
    assert any(p.startswith("launcher.max_restarts=-1 must be >= 0") and "fix:" in p for p in problems)
    assert any(p.startswith("launcher.min_nodes=3 must be in 0..launcher.nodes=2") for p in problems)
    assert any("needs launcher.elastic=true" in p for p in problems)
    problems = check_train(TrainConfig(max_bad_steps=-1, straggler_every=-2, straggler_factor=1.0), dp=1)
    assert [p.split(" must")[0] for p in problems] == ["train.max_bad_steps=-1", "train.straggler_every=-2",
                                                       "train.straggler_factor=1.0"]


def test_slowed_rank_is_named_by_the_straggler_warning(tmp_path, capfd):
    run = str(tmp_path)
    cfg = config()
    cfg.train.max_steps, cfg.train.straggler_every, cfg.train.straggler_factor = 4, 2, 1.2
    launch_local(cfg, run, worker=slow_worker)
    err = capfd.readouterr().err
    rows = [r for r in read_rows(run) if "loss" in r]
    assert [("step_time_max" in r) for r in rows] == [False, True, False, True]
    for r in rows[1::2]:
        # rank 1's own work includes the sleep; rank 0's excludes its wait for rank 1 (comm_s)
        assert r["step_time_max"] >= SLOW_S > r["step_time_min"], r
        assert r["step_time_min"] <= r["step_time_median"] <= r["step_time_max"] and r["stragglers"] == [1]
    host = socket.gethostname()
    for step in (2, 4):
        assert f"megaft: straggler(s) at step {step}: rank 1 on {host} (pp=0 dp=1 cp=0 tp=0): " in err, err[-3000:]
    assert "train.straggler_factor=1.2" in err


def test_elastic_sweep_asks_slurm_for_a_node_range(tmp_path):
    """launcher.elastic + launcher.min_nodes: `--nodes=min-max`, so a requeue after a node failure (the
    presets' --requeue) is accepted on the nodes that remain; submitit still counts a full job's tasks."""
    from submitit.slurm.slurm import _make_sbatch_string

    from megaft.launch.submit import NodeSpec, Shape, resource_shape, sbatch_parameters

    cfg = small_config()
    cfg.parallel.tp, cfg.parallel.dp = 2, 2
    cfg.launcher.elastic, cfg.launcher.min_nodes = True, 1
    shape, problems = resource_shape(cfg, NodeSpec(tasks_per_node=2))
    assert (shape, problems) == (Shape(2, 2, 0, 1, min_nodes=1), []) and shape.tag() == "n2_m1_t2_g0_c1"
    preset = dict(job_name="megaft", partition=None, timeout_min=30, signal_delay_s=120, array_parallelism=2,
                  mem_gb=0, setup=[], additional_parameters={})
    params = sbatch_parameters(shape, preset)
    assert params["nodes"] == 2  # submitit's task count
    text = _make_sbatch_string(command="x", folder=tmp_path / "%j", **params)
    assert [ln for ln in text.splitlines() if "--nodes" in ln] == ["#SBATCH --nodes=1-2"], text
    assert "#SBATCH --requeue" in text.splitlines()
    cfg.launcher.elastic = False  # without elastic the node count is fixed
    assert resource_shape(cfg, NodeSpec(tasks_per_node=2))[0] == Shape(2, 2, 0, 1)


def test_requeued_elastic_job_asks_for_the_nodes_that_remain():
    from megaft.launch.preempt import shrink_requeued

    calls = []

    def scontrol(args, **_):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, "", "")

    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "mn[1-3]", "SLURM_TASKS_PER_NODE": "2(x3)",
           "SLURM_CPUS_PER_TASK": "4"}
    msg = shrink_requeued(["mn2"], env, run=scontrol)
    assert calls == [["scontrol", "update", "JobId=9", "NumNodes=2", "NumTasks=4", "NumCPUs=16", "ExcNodeList=mn2"]]
    assert msg == "megaft: job 9 asks for the 2 node(s) that remain (mn1, mn3; 4 tasks), without mn2"
    assert shrink_requeued([], env, run=scontrol) is None and len(calls) == 1  # nothing lost: untouched


def test_elastic_replans_ep_when_dp_no_longer_divides_it(tmp_path, capfd):
    """dp 8 -> 6 ranks: ep=4 no longer divides dp*cp, so it becomes gcd(4, 6) = 2 (still dividing
    the experts); a world where it still divides keeps it."""
    cfg = config(elastic=True, nproc=6)
    cfg.parallel.ep = 4
    note = adapt(cfg, 6, str(tmp_path))
    assert (cfg.parallel.dp, cfg.parallel.ep) == (6, 2)
    assert note == "parallel.ep 4 -> 2 (ep must divide dp*cp = 6; the experts' checkpoint slices are resharded)"
    assert note in capfd.readouterr().out
    kept = config(elastic=True, nproc=8)
    kept.parallel.ep = 4
    assert adapt(kept, 8, str(tmp_path)) is None and (kept.parallel.dp, kept.parallel.ep) == (8, 4)
