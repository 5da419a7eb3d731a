"""megaft-report on run dirs made by real tiny training runs (no Slurm: squeue is
replaced by a given queue, submitted.json is written by the launcher's own writer)."""
import csv
import dataclasses
import json
import pickle
import shutil
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from train_cases import small_config

from megaft import report
from megaft.commbench.app import run as commbench
from megaft.commbench.config import CommbenchConfig
from megaft.config import Config, register_configs
from megaft.launch.submit_record import merge_submitted
from megaft.parallel.grid import ParallelGrid
from megaft.perf.counts import flops_per_token
from megaft.perf.time import step_cost
from megaft.plan.shape import planning_config
from megaft.train import conf_dir
from megaft.training.loop import Trainer


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep dir: runs 0 and 1 trained (micro-batch 8 and 4), 2 = run 0 cut before its
    summary, 3 submitted and failed, 4 submitted and still queued, 5 invalid."""
    root = tmp_path_factory.mktemp("sweep")
    summaries = []
    for i, micro in enumerate((8, 4)):
        run_dir = root / str(i)
        run_dir.mkdir()
        summaries.append(Trainer(small_config(steps=4, micro=micro), ParallelGrid.single(), str(run_dir)).fit())
    shutil.copytree(root / "0", root / "2")
    (root / "2" / "summary.json").unlink()
    failed = root / ".submitit" / "77_0"
    failed.mkdir(parents=True)
    with open(failed / "77_0_0_result.pkl", "wb") as f:  # what submitit leaves when rank (task) 0 raised
        pickle.dump(("error", "Traceback (most recent call last):\n  ...\nRuntimeError: rank 1 ran out of memory"), f)
    shape = {"nodes": 1, "tasks_per_node": 2, "gpus_per_node": 0, "cpus_per_task": 1, "world_size": 2}
    merge_submitted(str(root), [
        {"num": 3, "overrides": "parallel.tp=2 train.seed=1", "run_dir": str(root / "3"), "status": "submitted",
         "job_id": "77_0", "array_job_id": "77", "shape": shape, "submitit_folder": str(failed)},
        {"num": 4, "overrides": "parallel.tp=2 train.seed=2", "run_dir": str(root / "4"), "status": "submitted",
         "job_id": "77_1", "array_job_id": "77", "shape": shape, "submitit_folder": str(root / ".submitit/77_1")},
        {"num": 5, "overrides": "parallel.tp=3", "run_dir": str(root / "5"), "status": "invalid",
         "problems": ["parallel.tp=3 does not divide model.n_heads=4; fix: pick tp among the divisors of 4"]}])
    return root, summaries


@pytest.fixture
def rows(sweep, monkeypatch):
    monkeypatch.setattr(report, "squeue_states", lambda: {"77_1": "PENDING", "12": "RUNNING"})
    return {r["run"]: r for r in report.collect(str(sweep[0]))}


def test_status_of_every_run(rows):
    assert {run: r["status"] for run, r in rows.items()} == {
        "0": "done", "1": "done", "2": "running", "3": "failed", "4": "pending", "5": "invalid"}
    assert rows["3"]["reason"] == "RuntimeError: rank 1 ran out of memory"
    assert "n_heads=4" in rows["5"]["reason"]
    assert rows["4"]["world_size"] == 2  # from the submitted shape


def test_numbers_come_from_the_summary(rows, sweep):
    for run, summary in zip(("0", "1"), sweep[1]):
        row = rows[run]
        for key in ("tokens_per_s", "final_loss", "eval_loss", "eval_accuracy", "world_size", "tp"):
            assert row[key] == summary[key], key
        assert row["peak_mem_gb"] == summary["peak_rss_bytes"] / 2**30 > 0
        assert row["mfu"] is None  # CPU: no peak to compare with
        assert row["kernels"] == "torch"  # auto on CPU: torch for every op
    mixed = {op: {"backend": b, "source": "measured"} for op, b in
             (("rmsnorm", "triton"), ("rope", "triton"), ("swiglu", "torch"), ("linear", "cuda"))}
    assert report.kernels_cell(mixed) == "triton(rmsnorm,rope) torch(swiglu) cuda(linear)"
    assert report.kernels_cell(None) is None  # summaries from before the record


def test_running_run_uses_its_metrics(rows, sweep):
    train = [json.loads(line) for line in (sweep[0] / "2" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in train if "loss" in m]
    assert rows["2"]["final_loss"] == train[-1]["loss"]
    assert min(m["tokens_per_s"] for m in train) <= rows["2"]["tokens_per_s"] <= max(m["tokens_per_s"] for m in train)


def test_mfu(sweep):
    summary = dict(sweep[1][0], device="cuda:0", device_name="NVIDIA H100 80GB HBM3", precision="bf16",
                   peak_tflops=None)
    tps = summary["tokens_per_s"]
    mfu = report._mfu(summary, tps, None)
    fpt = summary["flops_per_token"]  # written by the trainer from megaft.perf.counts
    cfg = small_config(steps=4)
    assert fpt == flops_per_token(cfg.model, cfg.data.seq_len)
    assert mfu == pytest.approx(tps * fpt / 989.4e12)
    assert report._mfu(summary, tps, 989.4 / 2) == pytest.approx(2 * mfu)  # --peak-tflops
    assert report._mfu(dict(summary, precision="fp32"), tps, None) == pytest.approx(mfu * 989.4 / 66.9)
    assert report._mfu(dict(summary, device_name="Some New GPU"), tps, None) is None
    assert report._mfu(dict(summary, device="cpu"), tps, None) is None  # CPU: no peak unless given
    assert report._mfu(dict(summary, device="cpu"), tps, 2.0) == pytest.approx(mfu * 989.4 / 2)
    # summary.json files from before flops_per_token: 6 * params + 12 * layers * dim * seq_len
    old = {k: v for k, v in summary.items() if k != "flops_per_token"}
    legacy = 6 * old["params"] + 12 * old["n_layers"] * old["dim"] * old["seq_len"]
    assert report._mfu(old, tps, None) == pytest.approx(tps * legacy / 989.4e12)


def test_phase_columns_are_means_of_the_metrics(rows, sweep):
    train = [json.loads(line) for line in (sweep[0] / "0" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in train if "loss" in m][1:]  # after the warm-up step
    for key in ("forward_s", "backward_s", "optimizer_s", "comm_s"):
        assert rows["0"][key] == pytest.approx(sum(m[key] for m in train) / len(train))
    assert rows["0"]["forward_s"] > 0 and rows["5"]["forward_s"] is None


def test_table_and_files(sweep, monkeypatch, capsys):
    monkeypatch.setattr(report, "squeue_states", lambda: None)  # no Slurm: submitted jobs are not "failed"
    out_dir = sweep[0] / "out"
    assert report.main([str(sweep[0]), "--out", str(out_dir)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("run "))
    assert all(col in header for col in ("status", "tokens_per_s", "mfu", "forward_s", "comm_s", "peak_mem_gb",
                                         "final_loss", "kernels"))
    assert "parallel.tp=3" in text and "5: invalid:" in text
    with open(out_dir / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["status"] for r in table] == ["pending", "pending", "invalid", "done", "done", "running"]
    assert json.loads((out_dir / "report.json").read_text())[3]["tokens_per_s"] == sweep[1][0]["tokens_per_s"]
    assert (out_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out_dir / "report.md").read_text().count("\n") == 2 + 6


def test_single_run_dir_and_errors(sweep, tmp_path, capsys):
    assert report.main([str(sweep[0] / "1"), "--no-plot", "--out", str(tmp_path)]) == 0
    assert [r["run"] for r in json.loads((tmp_path / "report.json").read_text())] == ["."]
    assert report.main([str(tmp_path / "missing")]) == 1
    assert report.main([str(tmp_path)]) == 1  # a dir without runs
    assert "no runs under" in capsys.readouterr().err


def test_communication_share_next_to_the_measured_bandwidths_prediction(tmp_path, capsys):
    """--commbench: a real dp=2 megaft-train run (cluster=cpu) and a real 2-rank megaft-commbench
    run. The measured share is comm_s over the phased step; the prediction is the cost model's
    exposed comm (dp_comm + pp_bubble) for the run's own layout with the measured links, and
    it grows when the links are slower. Bad arguments exit 2 naming the fix."""
    overrides = ["cluster=cpu", "parallel.tp=1", "parallel.dp=2", "launcher.nproc=2", "device=cpu",
                 "train.max_steps=5", "train.save_every=0", "train.export_hf=false", "train.progress=false",
                 "train.tensorboard=false"]
    runs = tmp_path / "runs"
    out = subprocess.run([sys.executable, "-m", "megaft.train", *overrides, f"hydra.run.dir={runs / 'dp2'}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    bench = Config()
    bench.device, bench.launcher.nproc, bench.parallel.tp = "cpu", 2, 1
    bench.commbench = CommbenchConfig(collectives=["all_reduce"], min_bytes=8192, max_bytes=262144, warmup=1,
                                      repeats=3, plot=False)
    assert commbench(bench, str(tmp_path / "bench")) == 0

    assert report.main([str(runs), "--commbench", str(tmp_path / "bench"), "--no-plot"]) == 0
    row = json.loads((runs / "report.json").read_text())[0]
    phases = [row[k] for k in ("forward_s", "backward_s", "optimizer_s", "comm_s")]
    assert row["comm_share"] == pytest.approx(row["comm_s"] / sum(phases)) and 0 < row["comm_share"] < 1
    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("train", overrides=overrides))

    def exposed(measured: str) -> tuple[float, float]:
        shaped, problems = planning_config(dataclasses.replace(
            cfg, cluster=dataclasses.replace(cfg.cluster, measured=measured)))
        assert problems == []
        cost = step_cost(shaped, shaped.cluster, 2)
        return cost.terms["dp_comm"] + cost.terms["pp_bubble"], cost.step_s

    comm, step = exposed(str(tmp_path / "bench"))
    assert comm > 0 and row["pred_comm_s"] == pytest.approx(comm, rel=1e-12)
    assert row["pred_comm_share"] == pytest.approx(comm / step, rel=1e-12)
    assert "communication share, measured vs predicted from the measured bandwidth: " in capsys.readouterr().out
    # The same commbench.json with every link 10x slower: the prediction grows.
    doc = json.loads((tmp_path / "bench" / "commbench.json").read_text())
    for r in doc["results"]:
        r["time_s"], r["algbw_gbps"], r["busbw_gbps"] = 10 * r["time_s"], r["algbw_gbps"] / 10, r["busbw_gbps"] / 10
    (tmp_path / "slow.json").write_text(json.dumps(doc))
    assert report.main([str(runs), "--commbench", str(tmp_path / "slow.json"), "--no-plot"]) == 0
    slow = json.loads((runs / "report.json").read_text())[0]
    assert slow["pred_comm_s"] == pytest.approx(exposed(str(tmp_path / "slow.json"))[0], rel=1e-12)
    assert slow["pred_comm_s"] > 5 * row["pred_comm_s"] and slow["comm_share"] == row["comm_share"]
    # A run without cluster= (the file Hydra writes then) needs --cluster.
    bare = runs / "bare"
    shutil.copytree(runs / "dp2", bare, ignore=shutil.ignore_patterns("report.*"))
    hydra_cfg = yaml.safe_load((bare / ".hydra" / "config.yaml").read_text())
    hydra_cfg["cluster"] = OmegaConf.to_container(OmegaConf.structured(Config).cluster)
    (bare / ".hydra" / "config.yaml").write_text(yaml.safe_dump(hydra_cfg))
    capsys.readouterr()
    assert report.main([str(bare), "--commbench", str(tmp_path / "bench"), "--no-plot"]) == 0
    assert "the run names no cluster" in capsys.readouterr().out
    assert json.loads((bare / "report.json").read_text())[0]["pred_comm_s"] is None
    assert report.main([str(bare), "--commbench", str(tmp_path / "bench"), "--cluster", "cpu", "--no-plot"]) == 0
    assert json.loads((bare / "report.json").read_text())[0]["pred_comm_s"] == pytest.approx(comm, rel=1e-12)
    for args, message in ((["--commbench", str(tmp_path / "nowhere")], "--commbench"),
                          (["--commbench", str(tmp_path / "bench"), "--cluster", "h900"], "one of a100"),
                          (["--cluster", "cpu"], "--cluster goes with --commbench")):
        assert report.main([str(runs), "--no-plot", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "fix:" in err
