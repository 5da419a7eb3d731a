"""`megaft-plan plan.calibrate=RUN_DIR` (megaft.plan.calibrate, issue 42): a finished CPU run's phase
times set the cluster's factors (megaft.perf.rates), the planner's prediction of that run's layout then
equals the run's mean step; the factors scale the terms they name and nothing else; a run of another
family, device or precision is refused with the fix; the factors are written and reused."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys

import pytest
from multirank import spawn
from test_plan import checkpoint, composed
from train_cases import read_rows, small_config
from train_cases import run as train

from megaft.config.cluster import ClusterConfig
from megaft.parallel.grid import ParallelGrid
from megaft.perf.time import step_cost
from megaft.plan.calibrate import BOUNDS, mismatch
from megaft.plan.shape import planning_config
from megaft.training.run_config import read_run_config

SHAPE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
         "model.max_seq_len=64", "data.seq_len=32", "train.global_batch_size=16"]  # train_cases.small_config's
PHASES = ("forward_s", "backward_s", "optimizer_s", "comm_s")  # megaft.training.phases.PHASE_KEYS


def train_dp2(rank: int, world: int, root: str) -> None:
    """6 steps of the small model at dp=2, ZeRO-0 and ZeRO-1, 2 micro-batches per rank: every phase has time."""
    for zero in (0, 1):
        cfg = small_config(steps=6, micro=4)
        cfg.parallel.dp, cfg.parallel.zero = 2, zero
        train(cfg, ParallelGrid.build(tp=1, dp=2, pp=1, device="cpu"), os.path.join(root, f"zero{zero}"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("calibrate"))
    spawn(2, train_dp2, root)
    return root


@pytest.fixture(scope="module")
def run_dir(runs) -> str:
    return os.path.join(runs, "zero0")


def plan(*overrides: str):
    return composed(["cluster=cpu", *SHAPE, *overrides])


def measured_means(run_dir: str) -> dict:
    """The run's mean step and phases over its steady steps, from its files."""
    rows = [r for r in read_rows(run_dir) if "loss" in r][1:]  # the first step is warm-up
    summary = json.loads(open(os.path.join(run_dir, "summary.json")).read())
    out = {k: statistics.fmean(r[k] for r in rows) for k in PHASES}
    out["step_s"] = statistics.fmean(summary["tokens"] / summary["steps"] / r["tokens_per_s"] for r in rows)
    return out


@pytest.mark.parametrize("zero", [0, 1])
def test_a_run_calibrates_the_prediction_of_its_layout_to_its_mean_step(runs, zero):
    """The run's config priced on the calibrated cluster takes the run's mean step over its steady steps
    (the overhead is the rest: to float rounding), and no phase group longer than the run measured it.
    At ZeRO-0 the groups share no term, so each equals its measurement (bisection to 1e-9 of the
    factor); at ZeRO-1 the parameter all-gather sits in the optimizer step and bounds comm_scale."""
    run_dir = os.path.join(runs, f"zero{zero}")
    shaped, problems = planning_config(plan(f"plan.calibrate={run_dir}"))
    assert problems == []
    c, meas = shaped.cluster, measured_means(run_dir)
    ran = read_run_config(run_dir)
    cost = step_cost(planning_config(dataclasses.replace(ran.config, cluster=c))[0], c, ran.world_size)
    assert cost.step_s == pytest.approx(meas["step_s"], rel=1e-9)
    t = cost.terms
    groups = {"forward+backward": (t["compute"] + t["tp_comm"] + t["zero_comm"],
                                   meas["forward_s"] + meas["backward_s"]),
              "optimizer": (t["optimizer"] + t["param_gather"], meas["optimizer_s"]),
              "exposed comm": (t["dp_comm"] + t["pp_bubble"], meas["comm_s"])}
    assert all(predicted <= measured * (1 + 1e-6) for predicted, measured in groups.values()), groups
    assert t["overhead"] == pytest.approx(meas["step_s"] - sum(p for p, _ in groups.values()), rel=1e-9)
    if zero == 0:
        for predicted, measured in groups.values():
            assert predicted == pytest.approx(measured, rel=1e-6)
        # every factor measured (none at a bound) and the CPU preset's figures were off: the curve moved
        assert all(BOUNDS[0] < getattr(c, k) < BOUNDS[1] for k in ("compute_scale", "comm_scale", "optimizer_scale"))
        assert t["overhead"] == pytest.approx(meas["step_s"] - sum(meas[k] for k in PHASES), rel=1e-6)
    uncalibrated = plan().cluster
    before = step_cost(planning_config(dataclasses.replace(ran.config, cluster=uncalibrated))[0], uncalibrated,
                       ran.world_size)
    assert abs(before.step_s / meas["step_s"] - 1) > 0.05


def test_the_factors_scale_the_terms_they_name(tmp_path):
    """compute_scale multiplies every compute second (GEMM curve, attention, elementwise kernels and
    launches: h100's curve), comm_scale every collective (tp's all-reduces, not overlapped), and
    optimizer_scale the AdamW update, exactly; step_overhead_s is the overhead term."""
    cfg = composed([f"model.init_from={checkpoint(tmp_path, '8B')}", "cluster=h100", "data.seq_len=4096",
                    "model.max_seq_len=4096", "train.global_batch_size=32", "precision=bf16", "parallel.tp=2",
                    "parallel.zero=1", "train.micro_batch_size=1"])
    shaped, problems = planning_config(cfg)
    assert problems == []
    base = shaped.cluster
    one = step_cost(shaped, base, 8)
    scaled = step_cost(shaped, dataclasses.replace(base, compute_scale=1.7, comm_scale=2.5, optimizer_scale=3.0,
                                                   step_overhead_s=0.25), 8)
    assert one.terms["compute"] > 0 and one.terms["tp_comm"] > 0 and one.terms["overhead"] == 0
    assert scaled.terms["compute"] == pytest.approx(1.7 * one.terms["compute"], rel=1e-12)
    assert scaled.terms["tp_comm"] == pytest.approx(2.5 * one.terms["tp_comm"], rel=1e-12)
    assert scaled.terms["param_gather"] == pytest.approx(2.5 * one.terms["param_gather"], rel=1e-12)
    assert scaled.terms["optimizer"] == pytest.approx(3.0 * one.terms["optimizer"], rel=1e-12)
    assert scaled.terms["overhead"] == 0.25 and scaled.peak_tflops == one.peak_tflops  # MFU's peak is the datasheet's


def test_a_run_of_another_family_device_or_precision_is_refused(run_dir):
    cases = {"model.arch=qwen2": "the run trained model.arch=llama (tiny), this plan model.arch=qwen2",
             "cluster=h100": "the run ran on CPU, this plan is for cluster=h100 (gpu_type=h100)",
             "precision=bf16": "the run ran precision=fp32, this plan precision=bf16; fix: precision=fp32"}
    for override, message in cases.items():
        _, problems = planning_config(plan(f"plan.calibrate={run_dir}", override))
        assert any(message in p and "fix: " in p for p in problems), (override, problems)
    h100 = ClusterConfig(name="h100", gpu_type="h100")
    run = {"arch": "llama", "model": "x", "device": "cuda:0", "precision": "bf16"}
    cfg = plan("precision=bf16")
    assert mismatch({**run, "device_name": "NVIDIA H100 80GB HBM3"}, cfg, h100, "r") == []
    assert "ran on NVIDIA A100-SXM4-80GB" in mismatch({**run, "device_name": "NVIDIA A100-SXM4-80GB"}, cfg, h100,
                                                      "r")[0]
    assert "CPU ranks" in mismatch({**run, "device_name": "NVIDIA H100"}, cfg, plan().cluster, "r")[0]


def test_a_run_without_phase_times_or_steady_steps_is_refused(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    (path / "summary.json").write_text(json.dumps({"steps": 3, "tokens": 300, "world_size": 1}))
    lines = [{"step": i + 1, "loss": 1.0, "tokens_per_s": 100.0} for i in range(3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    _, problems = planning_config(plan(f"plan.calibrate={path}"))
    assert any("lack the phase times" in p and "train.log_phases=true" in p for p in problems), problems
    (path / "metrics.jsonl").write_text(json.dumps(lines[0]) + "\n")
    _, problems = planning_config(plan(f"plan.calibrate={path}"))
    assert any("none after the warm-up step" in p for p in problems), problems
    _, problems = planning_config(plan(f"plan.calibrate={tmp_path / 'nothing'}"))
    assert any("neither a run directory" in p for p in problems), problems


def test_megaft_plan_prints_writes_and_reuses_the_factors(run_dir, tmp_path):
    """The command prints what it calibrated from and the factors, writes calibration.json beside
    plan.json; plan.calibrate=<that file> and the printed overrides give the same cluster."""
    out = subprocess.run([sys.executable, "-m", "megaft.plan.app", "cluster=cpu", *SHAPE, f"plan.calibrate={run_dir}",
                          "plan.top_k=2", f"hydra.run.dir={tmp_path / 'plan'}"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"calibrated from {run_dir}" in out.stdout and "factors: cluster.compute_scale=" in out.stdout
    saved = json.loads((tmp_path / "plan" / "calibration.json").read_text())
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert doc["calibration"] == saved and doc["cluster"]["compute_scale"] == saved["factors"]["compute_scale"]
    direct = planning_config(plan(f"plan.calibrate={run_dir}"))[0].cluster
    reused = planning_config(plan(f"plan.calibrate={tmp_path / 'plan' / 'calibration.json'}"))[0].cluster
    typed = planning_config(plan(*saved["overrides"]))[0].cluster
    for key, value in saved["factors"].items():
        assert getattr(direct, key) == getattr(reused, key) == value
        assert getattr(typed, key) == pytest.approx(value, rel=1e-5)  # printed to 6 significant digits
    assert f"plan.calibrate= it, or the overrides {' '.join(saved['overrides'])}" in out.stdout
