"""LoRA training under every parallel layout equals the single-process LoRA run (issue 15),
through megaft-verify's machinery (megaft.verify.run: loss and grad norm per step, and every
adapter's step-1 gradient by name, read back from the step-1 checkpoints): one spawned
group per layout, 10 fp32 steps on a tiny random Llama checkpoint.

* tp=2 with sequence parallel and lora.dropout=0.1: the adapter dropout masks are drawn
  whole and sliced, so the tp ranks and the single process draw the same masks;
* tp=1 pp=2 dp=2 with ZeRO-2 (world 4): dp-reduced adapter grads, sharded adapter state;
* tp=2 pp=2 (world 4).
The tp=2 run's adapter checkpoint also resumes at tp=1 (resharded) like the single process.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from models.arch_fixture import make_hf

from lora.lora_fixture import lora_config, write_data
from megaft.config import Config, validate
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.verify.run import run_verify

# fp32: the layouts only reorder sums (~1e-7 relative); issue 15 asks for 1e-5 on the losses.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_base")
    make_hf(str(root / "ckpt"), "llama3")
    return str(root / "ckpt"), write_data(root / "train.jsonl")


def layout_config(base, *, tp: int, pp: int = 1, dp: int = 1, zero: int = 0, sp: bool = False, **lora) -> Config:
    ckpt, data = base
    cfg = Config()
    cfg.model.init_from = ckpt
    cfg.data.path, cfg.data.seq_len = data, 16
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 8
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = tp, pp, dp, zero
    cfg.parallel.sequence_parallel = sp
    cfg.launcher.nproc = tp * pp * dp
    cfg.optim.lr = 1e-2  # adapters start at B = 0: a large step makes every one of them move
    cfg.verify.steps = 10
    cfg.lora = lora_config(**lora)
    return cfg


def check(report) -> None:
    assert report.passed, report.format()
    assert [r.step for r in report.rows] == list(range(1, 11))
    assert max(r.loss_rel for r in report.rows) <= LOSS_RTOL, report.format()
    names = [n for n, _ in report.grads]
    # only adapters have gradients (and optimizer state): the checkpoints hold nothing else
    assert names and all(".adapter." in n for n in names), names


def test_tp2_sequence_parallel_with_dropout_equals_single_process(tmp_path, base):
    cfg = layout_config(base, tp=2, sp=True, dropout=0.1)
    report = run_verify(cfg, str(tmp_path / "verify"))
    check(report)
    names = {n for n, _ in report.grads}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert any(f"{proj}.adapter.A" in n for n in names) and any(f"{proj}.adapter.B" in n for n in names), proj
    # The tp=2 run's step-5 adapter checkpoint resumed at tp=1 (resharded: column B and row A
    # joined) continues like the uninterrupted single process (dropout masks too: its RNG state).
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "verify" / "layout" / "checkpoints" / "step_000005", run / "checkpoints" / "step_000005")
    one = layout_config(base, tp=1, dropout=0.1)
    one.train.max_steps, one.train.eval_every, one.train.progress, one.train.tensorboard = 10, 10, False, "false"
    one.kernels.backend, one.optim.fused = "torch", "torch"  # as the reference run (megaft.verify.run)
    assert validate(one, 1) == []
    Trainer(one, ParallelGrid.single(), str(run)).fit()
    got, want = losses(run), losses(tmp_path / "verify" / "reference")
    assert sorted(got) == [6, 7, 8, 9, 10]
    for step, loss in got.items():
        assert abs(loss - want[step]) <= LOSS_RTOL * abs(want[step]), (step, loss, want[step])


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="4 gloo ranks need at least 2 cores to finish in time")
def test_pp2_dp2_zero2_equals_single_process(tmp_path, base):
    check(run_verify(layout_config(base, tp=1, pp=2, dp=2, zero=2), str(tmp_path / "verify")))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="4 gloo ranks need at least 2 cores to finish in time")
def test_tp2_pp2_equals_single_process(tmp_path, base):
    check(run_verify(layout_config(base, tp=2, pp=2, rslora=True), str(tmp_path / "verify")))
