"""The pieces of `megaft-plan plan.probe=K` and `megaft-scale` that need no Slurm: the generated
multirun points, the study's points, the error per term and the scaling columns. The Slurm
runs themselves are tests/slurm/test_plan_probe.py and tests/slurm/test_scale.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megaft.config import register_configs
from megaft.perf.time import TERMS
from megaft.plan.multirun import measured, multirun_command, points_by_name, write_group
from megaft.plan.probe import launcher_overrides, term_errors
from megaft.scale.app import report, split_args
from megaft.scale.report import add_scaling
from megaft.scale.study import study_points

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")
register_configs()


def config(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_object(compose("train", overrides=list(overrides)))


def test_generated_points_compose_like_overrides(tmp_path):
    """A point's file (+group=name) gives the same config as its overrides on the command line."""
    layout = ["parallel.tp=1", "parallel.dp=2", "parallel.schedule=1f1b", "parallel.sequence_parallel=false",
              "parallel.offload=none", "train.micro_batch_size=4", "model.recompute=selective", "launcher.nodes=1"]
    write_group(str(tmp_path), "plan_probe", {"rank1": layout})
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        via_file = compose("train", overrides=[f"hydra.searchpath=['file://{tmp_path}']", "+plan_probe=rank1"])
        via_cli = compose("train", overrides=layout)
    for key in ("parallel", "train", "model", "launcher"):
        assert via_file[key] == via_cli[key], key
    assert via_file.parallel.dp == 2 and via_file.model.recompute == "selective"


def test_multirun_command_sweeps_the_group_and_waits():
    cmd = multirun_command(group="g", names=["a", "b"], conf_root="/c", sweep_dir="/s",
                           launcher=["hydra.launcher.timeout_min=5", "hydra.launcher.wait=false"],
                           common=["device=cpu"])
    assert cmd[:4] == [sys.executable, "-m", "megaft.train", "-m"]
    assert cmd[4:] == ["hydra/launcher=slurm", "hydra.launcher.timeout_min=5",
                                         "hydra.launcher.wait=true", "hydra.sweep.dir=/s",
                                         "hydra.searchpath=['file:///c']", "+g=a,b", "device=cpu"]
    assert launcher_overrides(["hydra.run.dir=x", "hydra/launcher=slurm_cpu", "hydra.launcher.nodes=2"]) == \
        ["hydra/launcher=slurm_cpu", "hydra.launcher.nodes=2"]


def run_dir(path, steps_tps, phases=(0.02, 0.04, 0.01, 0.03), world=2, tokens_per_step=256):
    """A finished run: summary.json and metrics.jsonl with the given tokens/s per step."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval_loss": 3.0}) + "\n")
        for i, tps in enumerate(steps_tps):
            f.write(json.dumps({"step": i + 1, "loss": 3.0, "tokens_per_s": tps,
                                **dict(zip(("forward_s", "backward_s", "optimizer_s", "comm_s"), phases))}) + "\n")
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump({"world_size": world, "steps": len(steps_tps), "tokens": tokens_per_step * len(steps_tps),
                   "tokens_per_s": 1.0}, f)
    return str(path)


def test_measured_skips_the_warm_up_step(tmp_path):
    meas = measured(run_dir(tmp_path / "r", [10.0, 100.0, 400.0, 200.0]))
    assert meas["tokens_per_s"] == 200.0 and meas["tokens_per_s_per_gpu"] == 100.0  # median of 100, 400, 200
    assert meas["step_s"] == 256 / 200.0 and meas["steady_steps"] == 3
    assert meas["comm_s"] == pytest.approx(0.03)
    assert measured(str(tmp_path / "missing")) is None


def test_term_errors_group_the_model_terms_by_measured_phase():
    terms = dict.fromkeys(TERMS, 0.0)
    terms.update(compute=0.05, tp_comm=0.01, optimizer=0.004, param_gather=0.006, dp_comm=0.02, pp_bubble=0.01)
    cost = SimpleNamespace(terms=terms, step_s=sum(terms.values()))
    meas = {"forward_s": 0.02, "backward_s": 0.04, "optimizer_s": 0.02, "comm_s": 0.015, "step_s": 0.1}
    err = term_errors(cost, meas)
    assert err["forward+backward"] == pytest.approx({"predicted_s": 0.06, "measured_s": 0.06, "ratio": 1.0})
    assert err["optimizer"]["ratio"] == pytest.approx(0.5)
    assert err["exposed comm"]["ratio"] == pytest.approx(2.0)
    assert err["not modeled"]["measured_s"] == pytest.approx(0.005)
    assert err["step"]["ratio"] == pytest.approx(1.0)


def test_strong_and_weak_points():
    cfg = config("parallel.tp=2", "train.global_batch_size=16", "train.micro_batch_size=2")
    strong, problems = study_points(cfg, "strong", [1, 2, 4], ranks_per_node=2, place_nodes=True)
    assert problems == []
    assert [(p["name"], p["world_size"], p["dp"], p["global_batch_size"]) for p in strong] == \
        [("n1", 2, 1, 16), ("n2", 4, 2, 16), ("n4", 8, 4, 16)]
    assert strong[1]["overrides"] == ["parallel.dp=2", "train.global_batch_size=16", "launcher.nodes=2"]
    weak, _ = study_points(cfg, "weak", [1, 2, 4], ranks_per_node=2, place_nodes=False)
    assert [(p["dp"], p["global_batch_size"]) for p in weak] == [(1, 16), (2, 32), (4, 64)]
    assert all(not any(o.startswith("launcher.nodes") for o in p["overrides"]) for p in weak)
    # Every problem at once, each naming its fix.
    _, problems = study_points(cfg, "strong", [1, 3, 32], ranks_per_node=1, place_nodes=False)
    assert len(problems) == 3 and "tp*cp*pp = 2" in problems[0] and "micro_batch_size" in problems[2]
    assert study_points(cfg, "linear", [2, 1], 1, False)[1][0].startswith("mode='linear'")


def test_scale_args_split_own_keys_from_training_and_launcher():
    own, task, launcher, sweep = split_args(["mode=weak", "nodes=[1,2]", "ranks_per_node=1", "place_nodes=false",
                                             "hydra/launcher=slurm_cpu", "hydra.launcher.timeout_min=3",
                                             "hydra.sweep.dir=/x", "device=cpu", "parallel.tp=1"])
    assert own == {"mode": "weak", "nodes": [1, 2], "ranks_per_node": 1, "place_nodes": False}
    assert (task, launcher, sweep) == (["device=cpu", "parallel.tp=1"],
                                       ["hydra/launcher=slurm_cpu", "hydra.launcher.timeout_min=3"], "/x")
    with pytest.raises(ValueError, match="hydra.run.dir"):
        split_args(["hydra.run.dir=/y"])


def test_scaling_columns(tmp_path):
    """Speedup against the fewest nodes, ideal, efficiency and communication share."""
    rows = []
    for i, (nodes, tps, comm) in enumerate(((1, 1000.0, 0.0), (2, 1500.0, 0.05), (4, 2000.0, 0.1))):
        run_dir(tmp_path / str(i), [1.0, tps, tps], phases=(0.1, 0.2, 0.05, comm))
        rows.append({"run": str(i), "overrides": f"+scale_point=n{nodes} device=cpu", "status": "done"})
    rows.append({"run": "3", "overrides": "+scale_point=n8", "status": "failed"})
    study = {"mode": "strong", "ranks_per_node": 1, "points": [{"name": f"n{n}", "nodes": n} for n in (1, 2, 4, 8)]}
    add_scaling(rows, str(tmp_path), study)
    assert [r["speedup"] for r in rows] == [1.0, 1.5, 2.0, None]
    assert [r["ideal"] for r in rows] == [1.0, 2.0, 4.0, None]
    assert [r["efficiency"] for r in rows] == [1.0, 0.75, 0.5, None]
    assert rows[1]["comm_share"] == pytest.approx(0.05 / 0.4) and rows[0]["comm_share"] == 0.0
    assert rows[3]["nodes"] == 8 and rows[3]["comm_share"] is None


def test_points_by_name_reads_submitted_json(tmp_path):
    (tmp_path / "submitted.json").write_text(json.dumps({"points": [
        {"num": 0, "overrides": "+plan_probe=rank1 device=cpu", "run_dir": "/r/0", "status": "submitted"},
        {"num": 1, "overrides": "+plan_probe=rank2 device=cpu", "run_dir": "/r/1", "status": "invalid"}]}))
    got = points_by_name(str(tmp_path), "plan_probe")
    assert {k: v["run_dir"] for k, v in got.items()} == {"rank1": "/r/0", "rank2": "/r/1"}


@pytest.mark.parametrize("args, message", [
    (["nodes=[2,1]"], "must be increasing"),
    (["mode=linear"], "mode='linear'"),
    (["parallel.tp=2", "nodes=[1,3]", "ranks_per_node=1"], "tp*cp*pp = 2"),
    (["train.no_such_key=1"], "no_such_key"),
])
def test_scale_exits_2_before_submitting(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "megaft.scale.app", f"hydra.sweep.dir={tmp_path}/s", *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not os.path.exists(tmp_path / "s")



def test_scale_runs_megaft_report_as_its_own_command(tmp_path, capfd):
    # megaft-scale's last step is `python -m megaft.report <sweep dir>` (megaft.report reads the
    # study; megaft.scale never imports it): that command exists and its status comes back.
    assert report(str(tmp_path)) == 1
    assert "megaft-report: no runs under" in capfd.readouterr().err


def test_plan_rejects_a_bad_probe(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megaft.plan.app", "cluster=cpu", "plan.probe=-1",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "plan.probe=-1 must be >= 0" in out.stderr, out.stderr


def test_the_console_scripts_pass_their_exit_status_on(tmp_path):
    # megaft-scale's main() returns its status; the console script used to drop it and exit 0
    script = os.path.join(os.path.dirname(sys.executable), "megaft-scale")
    out = subprocess.run([script, "model.nonsense=1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and "megaft-scale: Could not override 'model.nonsense'" in out.stderr, out
