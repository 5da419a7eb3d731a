"""Run metrics (issue 6 part 9): model FLOPs per token and MFU, per-phase step times,
TensorBoard event files equal to metrics.jsonl, and train.tensorboard validation."""
import glob
import json
import os

import numpy as np
import pytest
import torch
from multirank import spawn
from train_cases import read_rows, small_config

from megaft.config import Config
from megaft.config import train as train_config
from megaft.config.kernels import OPS
from megaft.config.model import ModelConfig
from megaft.parallel.grid import ParallelGrid
from megaft.perf import counts as flops
from megaft.perf import hardware
from megaft.training.loop import Trainer
from megaft.training.phases import PHASE_KEYS, PhaseTimer
from megaft.validation import validate

STEPS = 4
PEAK = 0.5  # TFLOP/s given on CPU, where the device table knows no peak


def test_flops_per_token_counts_gqa_attention_and_head():
    m = ModelConfig(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=100)
    hd = 8
    per_layer = 64 * 64 + 2 * 64 * 2 * hd + 64 * 64 + 3 * 64 * 96  # q, k+v (2 kv heads), o, SwiGLU
    assert flops.matmul_params(m) == 3 * per_layer + 64 * 100
    assert flops.flops_per_token(m, 32) == 6 * (3 * per_layer + 64 * 100) + 12 * 3 * 8 * hd * 32
    # without GQA, and counting the weights that multiply, it is the PaLM formula of older summaries
    mha = ModelConfig(dim=64, n_layers=3, n_heads=8, ffn_dim=96, vocab_size=100)
    assert flops.flops_per_token(mha, 32) == flops.flops_per_token_from_params(flops.matmul_params(mha), 3, 64, 32)
    assert flops.flops_per_token(mha, 32) > flops.flops_per_token(m, 32)


def test_peak_table():
    assert hardware.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert hardware.peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 66.9
    assert hardware.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0  # not the SXM part's
    assert hardware.peak_tflops("NVIDIA H100 NVL", "bf16") == 835.0
    assert hardware.peak_tflops("NVIDIA GH200 480GB", "fp16") == 989.4
    assert hardware.peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert hardware.peak_tflops("NVIDIA B200", "bf16") == 2250.0
    assert hardware.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert hardware.peak_tflops("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 tensor cores
    assert hardware.peak_tflops("Tesla V100-SXM2-32GB", "fp16") == 125.0
    assert hardware.peak_tflops("Some New GPU", "bf16") is None
    assert hardware.device_peak_tflops(torch.device("cpu"), "bf16") is None
    assert hardware.device_peak_tflops(torch.device("cpu"), "bf16", configured=3.0) == 3.0
    assert flops.mfu(1000.0, 2e9, 2, 1.0) == pytest.approx(1.0)


def test_one_device_table_serves_memory_budgets_and_peaks():
    # The Slurm presets' memory budgets, in the order the unknown-type error lists them
    assert list(hardware.GPU_MEMORY_GIB.items()) == [
        ("t4", 14.7), ("v100-16g", 15.7), ("v100-32g", 31.7), ("a10g", 22.1), ("l4", 22.0), ("l40s", 44.3),
        ("a100-40g", 39.3), ("a100-80g", 79.1), ("h100", 79.1), ("h100-nvl", 93.1), ("gh200", 94.5),
        ("h200", 139.7), ("b200", 178.3), ("mi250x", 63.9), ("mi300x", 191.9)]
    assert hardware.gpu_type_memory("H100") == (79.1, [])
    gib, problems = hardware.gpu_type_memory("h900")
    assert gib is None and "hydra.launcher.gpu_type='h900' is unknown" in problems[0] and "mi300x" in problems[0]
    # a gpu_type's peaks are those of the GPU name it stands for
    for key, name in (("h100", "NVIDIA H100 80GB HBM3"), ("gh200", "NVIDIA GH200 480GB"), ("a100-40g", "NVIDIA A100"),
                      ("h100-nvl", "NVIDIA H100 NVL"), ("mi300x", "AMD Instinct MI300X")):
        assert hardware.device(key).peaks["bf16"] == hardware.peak_tflops(name, "bf16"), key
    assert hardware.device("t4").peaks == {} and hardware.device("nope") is None



@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("metrics"))
    cfg = small_config(steps=STEPS)
    cfg.train.peak_tflops, cfg.train.tensorboard, cfg.train.eval_every = PEAK, "true", 2
    summary = Trainer(cfg, ParallelGrid.single(), run_dir).fit()
    return run_dir, cfg, summary


def _step_seconds(line: dict, cfg: Config) -> float:
    return cfg.train.global_batch_size * cfg.data.seq_len / line["tokens_per_s"]


def test_metrics_lines_carry_phases_and_mfu(run):
    run_dir, cfg, summary = run
    train = [r for r in read_rows(run_dir) if "loss" in r]
    assert len(train) == STEPS
    fpt = flops.flops_per_token(cfg.model, cfg.data.seq_len)
    for line in train:
        assert set(PHASE_KEYS) <= set(line)
        assert line["forward_s"] > 0 and line["backward_s"] > 0 and line["optimizer_s"] > 0
        assert line["comm_s"] >= 0
        # disjoint intervals inside the step: their sum cannot exceed it
        assert sum(line[k] for k in PHASE_KEYS) <= _step_seconds(line, cfg)
        assert line["mfu"] == pytest.approx(line["tokens_per_s"] * fpt / (PEAK * 1e12))
    assert summary["flops_per_token"] == fpt and summary["peak_tflops"] == PEAK
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * fpt / (PEAK * 1e12))
    # summary tokens/s: all tokens over all step time (the harmonic mean of the lines)
    step_time = sum(_step_seconds(line, cfg) for line in train)
    assert summary["tokens_per_s"] == pytest.approx(STEPS * 512 / step_time, rel=1e-6)
    with open(os.path.join(run_dir, "summary.json")) as f:
        written = json.load(f)
    assert written["mfu"] == summary["mfu"]
    # kernels.backend=auto on CPU: every op on torch, recorded with why (megaft.kernels.autotune)
    assert written["kernels"] == summary["kernels"] == {op: {"backend": "torch", "source": "cpu"} for op in OPS}


def test_tensorboard_scalars_equal_metrics_jsonl(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = run[0]
    assert glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    rows = read_rows(run_dir)
    for key in ("loss", "grad_norm", "forward_s", "mfu", "eval_loss"):
        want = [(r["step"], r[key]) for r in rows if key in r]
        got = [(s.step, s.value) for s in events.Scalars(key)]
        assert got == [(step, float(np.float32(v))) for step, v in want], key  # event files hold float32
    assert len(events.Scalars("loss")) == STEPS and [s.step for s in events.Scalars("eval_loss")] == [0, 2, 4]


def test_tensorboard_continues_a_resumed_run(tmp_path):
    """Stopped after step 3 (checkpoint at 2), resumed to 4: the events of step 3 from the
    first run are purged like its metrics line, so both files show one curve."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = small_config(steps=STEPS)
    cfg.train.save_every, cfg.train.tensorboard, cfg.train.eval_every = 2, "true", 100
    Trainer(cfg, ParallelGrid.single(), str(tmp_path)).fit(stop_after=3)
    Trainer(cfg, ParallelGrid.single(), str(tmp_path)).fit()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    want = [(r["step"], float(np.float32(r["loss"]))) for r in read_rows(str(tmp_path)) if "loss" in r]
    assert [s.step for s in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [(s.step, s.value) for s in events.Scalars("loss")] == want


def test_disabled_phase_timer_is_empty():
    timer = PhaseTimer(torch.device("cpu"), enabled=False)
    with timer.phase("forward"):
        pass
    timer.add("comm", 1.0)
    assert timer.result() == {}
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("backward"):
        pass
    timer.add("comm", 0.25)
    result = timer.result()
    assert result["comm_s"] == 0.25 and result["backward_s"] > 0 and result["forward_s"] == 0.0
    timer.start_step()
    assert timer.result() == dict.fromkeys(PHASE_KEYS, 0.0)


def test_tensorboard_setting_is_validated(monkeypatch):
    cfg = small_config()
    for value in ("auto", "true", "false", True, False):
        cfg.train.tensorboard = value
        assert not [p for p in validate(cfg, 1) if "tensorboard" in p], value
    cfg.train.tensorboard = "sometimes"
    assert any("train.tensorboard='sometimes' is unknown; fix: auto, true or false" in p for p in validate(cfg, 1))
    monkeypatch.setattr(train_config, "tensorboard_available", lambda: False)
    cfg.train.tensorboard = "true"
    (problem,) = [p for p in validate(cfg, 1) if "tensorboard" in p]
    assert "not installed" in problem and "train.tensorboard=auto" in problem
    assert not train_config.use_tensorboard("auto") and train_config.use_tensorboard("true")
    cfg.train.peak_tflops = -1
    assert any("train.peak_tflops=-1" in p for p in validate(cfg, 1))


# Two ranks: a 2-stage pipeline (phases wrap the runtime's handlers) and dp=2 with ZeRO-2.
PARALLEL_RUNS = {"pp2": dict(pp=2, dp=1, zero=0), "dp2_zero2": dict(pp=1, dp=2, zero=2)}


def train_parallel(rank: int, world: int, root: str) -> None:
    for name, par in PARALLEL_RUNS.items():
        cfg = small_config(steps=3)
        cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = par["pp"], par["dp"], par["zero"]
        cfg.train.micro_batch_size, cfg.train.tensorboard = 4, "false"
        cfg.data.task_eval_size = 4  # evaluation (greedy generation through the stages) is not under test
        run_dir = os.path.join(root, name)
        if name == "dp2_zero2":  # logger=wandb on 2 ranks: rank 0 alone writes the (offline) W&B run
            os.environ.update(WANDB_SILENT="true", WANDB_CONSOLE="off",
                              WANDB_CONFIG_DIR=os.path.join(root, "wb-config"))
            cfg.logger, cfg.wandb.mode = "wandb", "offline"
        os.makedirs(run_dir, exist_ok=True)
        Trainer(cfg, ParallelGrid.build(tp=1, pp=par["pp"], dp=par["dp"], device="cpu"), run_dir).fit()


def test_phases_under_pipeline_and_data_parallel(tmp_path):
    spawn(2, train_parallel, str(tmp_path))
    cfg = small_config(steps=3)
    for name in PARALLEL_RUNS:
        train = [r for r in read_rows(str(tmp_path / name)) if "loss" in r]
        assert len(train) == 3 and "mfu" not in train[0]  # CPU without train.peak_tflops
        assert not (tmp_path / name / "tensorboard").exists()
        for line in train:
            assert line["forward_s"] > 0 and line["backward_s"] > 0 and line["comm_s"] > 0, (name, line)
            assert sum(line[k] for k in PHASE_KEYS) <= _step_seconds(line, cfg), (name, line)
    from test_wandb import read_wandb_records

    assert len(glob.glob(str(tmp_path / "dp2_zero2" / "wandb" / "offline-run-*"))) == 1  # one run: rank 0's
    history = [r["history"] for r in read_wandb_records(str(tmp_path / "dp2_zero2")) if r["type"] == "history"]
    want = [(r["step"], r["loss"]) for r in read_rows(str(tmp_path / "dp2_zero2")) if "loss" in r]
    assert [(h["step"]["num"], h["item"]["loss"]) for h in history if "loss" in h["item"]] == want
    assert not (tmp_path / "pp2" / "wandb").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-event phase timers, device peak)")
def test_cuda_phases_mfu_and_memory_estimate(tmp_path):
    from megaft.perf.memory import estimate_memory

    cfg = small_config(steps=3)
    cfg.precision, cfg.device, cfg.train.tensorboard = "bf16", "cuda", "false"
    torch.cuda.reset_peak_memory_stats()
    summary = Trainer(cfg, ParallelGrid.single("cuda:0"), str(tmp_path)).fit()
    for line in [r for r in read_rows(str(tmp_path)) if "loss" in r]:
        assert line["forward_s"] > 0 and line["backward_s"] > 0 and line["optimizer_s"] > 0
        assert sum(line[k] for k in PHASE_KEYS) <= _step_seconds(line, cfg)
        assert ("mfu" in line) == (summary["peak_tflops"] is not None)
    assert summary["peak_tflops"] == flops.peak_tflops(torch.cuda.get_device_name(0), "bf16")
    est = estimate_memory(cfg, 1)
    for part in ("params", "grads", "optimizer"):
        assert summary["memory_bytes"][part] == pytest.approx(getattr(est, part), rel=0.05), part
    assert summary["peak_memory_bytes"] <= est.total
