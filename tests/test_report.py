"""megaft-report on run dirs made by real tiny training runs (no Slurm: squeue is
replaced by a given queue, submitted.json is written by the launcher's own writer)."""
import csv
import dataclasses
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from train_cases import small_config

from megaft import report
from megaft.commbench.app import run as commbench
from megaft.config import Config, conf_dir, register_configs
from megaft.config.commbench import CommbenchConfig
from megaft.launch.submit_record import merge_submitted
from megaft.parallel.grid import ParallelGrid
from megaft.perf.counts import flops_per_token
from megaft.perf.time import step_cost
from megaft.plan.shape import planning_config
from megaft.training.loop import Trainer
from megaft.training.run_config import read_run_config
from megaft.training.summary import SCHEMA_VERSION, RunSummary
from megaft.validation import validate


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
    monkeypatch.setattr(report.status, "squeue_states", lambda: {"77_1": "PENDING", "12": "RUNNING"})
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
    summary = dataclasses.replace(RunSummary.from_json(sweep[1][0]), device="cuda:0",
                                  device_name="NVIDIA H100 80GB HBM3", precision="bf16", peak_tflops=None)
    tps = summary.tokens_per_s
    mfu = report.run_mfu(summary, tps, None)
    fpt = summary.flops_per_token  # written by the trainer from megaft.perf.counts
    cfg = small_config(steps=4)
    assert fpt == flops_per_token(cfg.model, cfg.data.seq_len)
    assert mfu == pytest.approx(tps * fpt / 989.4e12)
    assert report.run_mfu(summary, tps, 989.4 / 2) == pytest.approx(2 * mfu)  # --peak-tflops

    def mfu_of(**changed):
        return report.run_mfu(dataclasses.replace(summary, **changed), tps, None)

    assert mfu_of(precision="fp32") == pytest.approx(mfu * 989.4 / 66.9)
    assert mfu_of(device_name="Some New GPU") is None
    assert mfu_of(device="cpu") is None  # CPU: no peak unless given
    assert report.run_mfu(dataclasses.replace(summary, device="cpu"), tps, 2.0) == pytest.approx(mfu * 989.4 / 2)
    # summary.json files from before flops_per_token: 6 * params + 12 * layers * dim * seq_len
    old = dataclasses.replace(summary, flops_per_token=None)
    legacy = 6 * old.params + 12 * old.n_layers * old.dim * old.seq_len
    assert report.run_mfu(old, tps, None) == pytest.approx(tps * legacy / 989.4e12)


def test_run_summary_round_trip(sweep):
    """summary.json is RunSummary's: what the trainer wrote reads back equal, writes back the
    same object, and the fields a run does not have (CPU: no GPU peak, no MFU) are left out."""
    written = json.loads((sweep[0] / "0" / "summary.json").read_text())
    assert written["schema"] == SCHEMA_VERSION and written == sweep[1][0]
    summary = RunSummary.read(str(sweep[0] / "0"))
    assert summary.to_json() == written and RunSummary.from_json(summary.to_json()) == summary
    assert summary.peak_rss_bytes > 0 and "peak_memory_bytes" not in written and "mfu" not in written
    assert summary.tp == summary.dp == summary.world_size == 1 and summary.kernels and summary.extra == {}
    newer = dict(written, schema=SCHEMA_VERSION + 1, tool_note="kept")  # a newer writer's key survives
    assert RunSummary.from_json(newer).to_json() == newer
    assert RunSummary.read(str(sweep[0] / "missing")) is None


def test_old_summary_without_schema_is_read(sweep, tmp_path, monkeypatch):
    """A summary.json from before RunSummary (no `schema`, no flops_per_token or kernels, an
    extra key): megaft-report reads it, and a launcher's restart count is added to it."""
    from megaft.launch.elastic import record_restarts

    old = {"steps": 4, "final_loss": 1.5, "tokens": 2048, "tokens_per_s": 1000.0, "wall_s": 3.0, "world_size": 2,
           "tp": 2, "dp": 1, "pp": 1, "precision": "bf16", "device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3",
           "model": "tiny", "params": 100_000, "n_layers": 2, "dim": 64, "seq_len": 32, "eval_loss": 1.7,
           "peak_memory_bytes": 2**30, "custom": "from a tool"}
    run = tmp_path / "old"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(old))
    summary = RunSummary.read(str(run))
    assert summary.schema == 1 and summary.extra == {"custom": "from a tool"} and summary.cp is None
    monkeypatch.setattr(report.status, "squeue_states", lambda: None)
    assert report.main([str(run), "--no-plot", "--out", str(tmp_path / "out")]) == 0
    row = json.loads((tmp_path / "out" / "report.json").read_text())[0]
    got = (row["status"], row["world_size"], row["tp"], row["final_loss"], row["eval_loss"])
    assert got == ("done", 2, 2, 1.5, 1.7)
    assert row["peak_mem_gb"] == 1.0 and row["kernels"] is None
    legacy = 6 * 100_000 + 12 * 2 * 64 * 32  # no flops_per_token: the count from the shape
    assert row["mfu"] == pytest.approx(1000.0 * legacy / (2 * 989.4e12))
    record_restarts(str(run), 3)
    again = json.loads((run / "summary.json").read_text())
    assert again["restarts"] == 3 and again["custom"] == "from a tool" and again["schema"] == 1


def test_phase_columns_are_means_of_the_metrics(rows, sweep):
    train = [json.loads(line) for line in (sweep[0] / "0" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in train if "loss" in m][1:]  # after the warm-up step
    for key in ("forward_s", "backward_s", "optimizer_s", "comm_s"):
        assert rows["0"][key] == pytest.approx(sum(m[key] for m in train) / len(train))
    assert rows["0"]["forward_s"] > 0 and rows["5"]["forward_s"] is None


def test_table_and_files(sweep, monkeypatch, capsys):
    monkeypatch.setattr(report.status, "squeue_states", lambda: None)  # no Slurm: submitted jobs are not "failed"
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
    # config.yaml is the config that ran: Hydra's, resolved (the tokenizer's vocabulary filled in)
    ran, composed = read_run_config(str(runs / "dp2")), cfg.model.vocab_size
    assert validate(cfg, 2) == [] and ran.config == cfg and (ran.world_size, ran.accumulation_steps) == (2, 1)
    assert composed == 0 < ran.config.model.vocab_size

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
    # A run from before config.yaml, without cluster= (the file Hydra writes then), needs --cluster.
    bare = runs / "bare"
    shutil.copytree(runs / "dp2", bare, ignore=shutil.ignore_patterns("report.*"))
    (bare / "config.yaml").unlink()
    hydra_cfg = yaml.safe_load((bare / ".hydra" / "config.yaml").read_text())
    hydra_cfg["cluster"] = OmegaConf.to_container(OmegaConf.structured(Config).cluster)
    (bare / ".hydra" / "config.yaml").write_text(yaml.safe_dump(hydra_cfg))
    capsys.readouterr()
    assert report.main([str(bare), "--commbench", str(tmp_path / "bench"), "--no-plot"]) == 0
    assert "the run names no cluster" in capsys.readouterr().out
    assert json.loads((bare / "report.json").read_text())[0]["pred_comm_s"] is None
    assert report.main([str(bare), "--commbench", str(tmp_path / "bench"), "--cluster", "cpu", "--no-plot"]) == 0
    assert json.loads((bare / "report.json").read_text())[0]["pred_comm_s"] == pytest.approx(comm, rel=1e-12)
    # config.yaml, where a run wrote one, is what is costed (the layout after any elastic change)
    shutil.copy(runs / "dp2" / "config.yaml", bare / "config.yaml")
    assert report.main([str(bare), "--commbench", str(tmp_path / "bench"), "--no-plot"]) == 0
    assert json.loads((bare / "report.json").read_text())[0]["pred_comm_s"] == pytest.approx(comm, rel=1e-12)
    for args, message in ((["--commbench", str(tmp_path / "nowhere")], "--commbench"),
                          (["--commbench", str(tmp_path / "bench"), "--cluster", "h900"], "one of a100"),
                          (["--cluster", "cpu"], "--cluster goes with --commbench")):
        assert report.main([str(runs), "--no-plot", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "fix:" in err


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_result_pickle_runs_nothing(tmp_path):
    # submitit's result file is read as plain data (issue 29): a planted object is refused and
    # the reason comes from the job's stderr log instead
    from megaft.report.status import failure_reason

    folder, marker = tmp_path / "77_0", tmp_path / "pwned"
    folder.mkdir()
    with open(folder / "77_0_0_result.pkl", "wb") as f:
        pickle.dump(("error", _RunsACommand(str(marker))), f)
    (folder / "77_0_0_log.err").write_text("Traceback ...\nValueError: the real reason\n")
    assert failure_reason({"submitit_folder": str(folder), "job_id": "77_0"}) == "ValueError: the real reason"
    assert not marker.exists()


def test_hf_ignore_keys_are_echoed_in_the_summary(sweep, tmp_path):
    # keys a user declared harmless (model.hf_ignore_keys, issue 24) are on record; other runs say nothing
    assert "hf_ignore_keys" not in sweep[1][0]
    cfg = small_config(steps=1)
    cfg.model.hf_ignore_keys = ["my_lab_flag"]
    Trainer(cfg, ParallelGrid.single(), str(tmp_path)).fit()
    assert json.load(open(tmp_path / "summary.json"))["hf_ignore_keys"] == ["my_lab_flag"]


def test_loss_curves_of_a_two_point_sweep(tmp_path, monkeypatch):
    """A real 2-point Hydra multirun (seeds 0 and 1) with logger=wandb wandb.mode=offline:
    megaft-report draws both runs' train and eval losses on curves.png, whose stored points
    (PNG text chunk and curves.json) are the runs' metrics.jsonl; each point is its own offline
    W&B run, named by its overrides, both in the sweep's group."""
    from test_wandb import read_wandb_records

    from megaft.report.curves import PNG_KEY

    sweep = tmp_path / "multirun" / "day" / "sweep"
    overrides = ["parallel.tp=1", "launcher.nproc=1", "device=cpu", "model.dim=64", "model.n_layers=2",
                 "model.ffn_dim=128", "train.max_steps=4", "train.eval_every=2", "train.micro_batch_size=8",
                 "train.global_batch_size=16",
                 "data.task_train_size=200", "data.task_eval_size=8", "data.seq_len=32", "train.progress=false",
                 "train.tensorboard=false", "logger=wandb", "wandb.mode=offline", "wandb.project=curves"]
    with socket.socket() as s:  # a free port for the rank's env:// rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # RANK/WORLD_SIZE as torchrun sets them: each point runs its one rank inside the Hydra process
    # (no spawned interpreter per point; the local launcher has its own tests)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WANDB_SILENT="true", WANDB_CONSOLE="off", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"))
    out = subprocess.run([sys.executable, "-m", "megaft.train", "-m", f"hydra.sweep.dir={sweep}", *overrides,
                          "train.seed=0,1"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    monkeypatch.setattr(report.status, "squeue_states", lambda: None)
    assert report.main([str(sweep)]) == 0
    assert (sweep / "report.png").is_file()
    stored = json.loads((sweep / "curves.json").read_text())
    text = dict(png_text(sweep / "curves.png"))
    assert json.loads(text[PNG_KEY]) == stored  # the same points in the PNG
    assert [(r["run"], r["label"]) for r in stored["runs"]] == [("0", "train.seed=0"), ("1", "train.seed=1")]
    assert "train.max_steps=4" in stored["common"]
    for run in stored["runs"]:
        lines = [json.loads(line) for line in (sweep / run["run"] / "metrics.jsonl").read_text().splitlines()]
        assert run["train"] == [[m["step"], m["loss"]] for m in lines if "loss" in m] and len(run["train"]) == 4
        assert run["eval"] == [[m["step"], m["eval_loss"]] for m in lines if "eval_loss" in m]
        assert [s for s, _ in run["eval"]] == [0, 2, 4] and "reward" not in run  # GRPO runs only
        (wb,) = [r["run"] for r in read_wandb_records(str(sweep / run["run"])) if r["type"] == "run"]
        assert wb["display_name"] == run["label"]  # the override the sweep varies
        assert (wb["project"], wb["run_group"]) == ("curves", "day/sweep")
    assert stored["runs"][0]["train"] != stored["runs"][1]["train"]  # two different runs, two lines


def png_text(path):
    """The text chunks of a PNG, read with Pillow (matplotlib's own dependency)."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return image.text.items()
