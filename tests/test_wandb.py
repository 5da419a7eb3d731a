"""logger=wandb (issue 28): an offline W&B run written by a real tiny training run, read
back with wandb's own reader of the .wandb transaction log (`wandb leet inspect --json`);
its history equals metrics.jsonl, its config is config.yaml, its summary summary.json."""
import glob
import html
import json
import os
import subprocess
import sys

import pytest
import yaml
from train_cases import read_rows, small_config

from megaft.config import wandb as wandb_config
from megaft.config.wandb import WandbConfig
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.training.wandb_log import run_identity
from megaft.validation import validate

pytest.importorskip("wandb")
STEPS = 4


def read_wandb_records(run_dir: str) -> list[dict]:
    """Every record of the run's offline .wandb file, as wandb's reader prints it."""
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    cmd = [wandb_cli] if os.path.isfile(wandb_cli) else [sys.executable, "-m", "wandb"]
    out = subprocess.run([*cmd, "leet", "inspect", "--json", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("wandb") / "my-run"
    run_dir.mkdir()
    env = {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_CODE": "true",
           "WANDB_CONFIG_DIR": str(run_dir.parent / "wandb-config"), "WANDB_CACHE_DIR": str(run_dir.parent / "cache")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = small_config(steps=STEPS)
        cfg.train.eval_every, cfg.train.tensorboard = 2, "false"
        cfg.logger, cfg.wandb = "wandb", WandbConfig(project="megaft-test", mode="offline", tags=["ci"])
        prompts = run_dir.parent / "prompts.jsonl"
        prompts.write_text('{"prompt": "abc<&>"}\n')
        cfg.train.sample_every, cfg.sample.prompts, cfg.sample.max_new_tokens = 2, str(prompts), 4
        summary = Trainer(cfg, ParallelGrid.single(), str(run_dir)).fit()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return str(run_dir), summary, read_wandb_records(str(run_dir))


def test_offline_history_equals_metrics_jsonl(wandb_run):
    run_dir, _, records = wandb_run
    history = [r["history"] for r in records if r["type"] == "history"]
    rows = read_rows(run_dir)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "forward_s", "eval_loss", "eval_accuracy"):
        want = [(r["step"], r[key]) for r in rows if key in r]
        got = [(h["step"].get("num", 0), h["item"][key]) for h in history if key in h["item"]]
        assert got == want and want, key  # JSON numbers: no float32 rounding, unlike TensorBoard
    assert [h["step"].get("num", 0) for h in history] == [0, 1, 2, 3, 4]  # eval lines join their step


def test_samples_reach_wandb_as_text(wandb_run):
    """The samples TensorBoard gets as text (MetricsLog.text) are HTML media of the W&B run."""
    run_dir, _, records = wandb_run
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    # the reader prints a media entry flattened: samples/0._type, samples/0.path
    logged = [(h["step"].get("num", 0), h["item"]) for r in records if r["type"] == "history"
              for h in [r["history"]] if "samples/0.path" in h["item"]]
    assert [step for step, _ in logged] == [s["step"] for s in samples] == [0, 2, 4]
    (files,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "files"))
    for (step, item), sample in zip(logged, samples):
        assert item["samples/0._type"] == "html-file"
        page = open(os.path.join(files, item["samples/0.path"])).read()
        assert html.escape(f"{sample['prompt']}\n\n→ {sample['text']}") in page, step


def test_offline_run_carries_config_summary_and_name(wandb_run):
    run_dir, summary, records = wandb_run
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["project"], run["display_name"], run.get("run_group")) == ("megaft-test", "my-run", None)
    assert run["tags"] == ["ci"]
    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config == yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))  # the config that ran
    assert config["train"]["max_steps"] == STEPS and config["derived"]["world_size"] == 1
    final: dict = {}
    for r in records:
        if r["type"] == "summary":
            final.update(r["summary"].get("update", {}))
    for key in ("final_loss", "tokens_per_s", "eval_loss", "steps", "params"):
        assert final[key] == summary[key], key
    assert records[-1]["type"] == "exit" and records[-1]["exit"].get("exit_code", 0) == 0


def test_sweep_points_are_named_by_overrides_and_grouped(tmp_path):
    sweep = tmp_path / "multirun" / "2026-11-27" / "10-00-00"
    point = sweep / "1"
    (point / ".hydra").mkdir(parents=True)
    (point / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["parallel.tp=2", "train.seed=1"]))
    assert run_identity(WandbConfig(), str(point)) == ("1", None)  # no sweep file: a single run
    (sweep / "multirun.yaml").write_text("{}\n")  # no sweep overrides on record: all of the point's
    assert run_identity(WandbConfig(), str(point)) == ("parallel.tp=2 train.seed=1", "2026-11-27/10-00-00")
    task = ["parallel.tp=2", "train.seed=range(4)"]  # what `megaft-train -m` wrote: only the seed varies
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task}}}))
    assert run_identity(WandbConfig(), str(point)) == ("train.seed=1", "2026-11-27/10-00-00")
    assert run_identity(WandbConfig(name="a", group="b"), str(point)) == ("a", "b")


def test_logger_settings_are_validated(monkeypatch):
    cfg = small_config()
    assert not [p for p in validate(cfg, 1) if "logger" in p or "wandb" in p]
    cfg.logger = "mlflow"
    assert any("logger='mlflow' is unknown; fix: logger=none or logger=wandb" in p for p in validate(cfg, 1))
    cfg.logger, cfg.wandb.mode = "wandb", "sometimes"
    assert any("wandb.mode='sometimes' is unknown; fix: online, offline" in p for p in validate(cfg, 1))
    cfg.wandb.mode = "offline"
    monkeypatch.setattr(wandb_config, "wandb_available", lambda: False)
    (problem,) = [p for p in validate(cfg, 1) if "wandb" in p]
    assert "not installed; fix: pip install wandb" in problem

