"""parallel.offload=cpu (issue 4, part 2): fp32 masters and Adam moments on the host,
updated by the C++ AdamW. Loss curves equal one process, device memory loses the
optimizer state to the host, resume is bitwise, and bad configs are refused."""
import json
import os

import pytest
import torch
from multirank import spawn
from torch import nn
from train_cases import DP_STEPS, dp_config, read_rows

from megaft.config.optim import OptimConfig
from megaft.optim.zero import build_optimizer
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import validate

# fp32: dp sums two ranks' partial gradients (one reordered add), so curves agree to
# rounding over 10 AdamW steps; 1e-5 relative is the bound.
RTOL = 1e-5
RUNS = {
    "dp2_zero0_offload": dict(dp=2, zero=0, bucket_mb=0.01, offload="cpu"),
    "dp2_zero1_offload": dict(dp=2, zero=1, bucket_mb=0.01, offload="cpu"),
    "dp2_zero2_offload": dict(dp=2, zero=2, bucket_mb=0.01, offload="cpu"),
    "dp2_zero3_offload": dict(dp=2, zero=3, offload="cpu"),
}
RESUMED = "dp2_zero2_offload"  # also stopped after 5 steps and resumed


def _fit(cfg, grid, run_dir, stop=None):
    os.makedirs(run_dir, exist_ok=True)
    Trainer(cfg, grid, run_dir).fit(stop_after=stop)


def _single_runs(root: str) -> None:
    """One process, without and with offload (the same kernel on the same floats)."""
    for name, offload in (("ref", "none"), ("ref_offload", "cpu")):
        _fit(dp_config(offload=offload), ParallelGrid.single(), os.path.join(root, name))


def _dp_runs(rank: int, world: int, root: str) -> None:
    grid = ParallelGrid.build(tp=1, dp=2, pp=1, device="cpu")
    for name, spec in RUNS.items():
        _fit(dp_config(**spec), grid, os.path.join(root, name))
    for stop in (5, None):
        cfg = dp_config(**RUNS[RESUMED])
        cfg.train.save_every = 5
        _fit(cfg, grid, os.path.join(root, f"{RESUMED}_resumed"), stop)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("offload"))
    _single_runs(root)
    spawn(2, _dp_runs, root)
    return root


def _curve(root, name):
    """Train rows' values (not the timings, which differ run to run)."""
    keep = ("step", "loss", "lr", "grad_norm", "comm_bytes")
    return [{k: r[k] for k in keep if k in r} for r in read_rows(os.path.join(root, name)) if "loss" in r]


def test_single_process_offload_is_bitwise_the_device_update(runs):
    assert len(_curve(runs, "ref")) == DP_STEPS
    assert _curve(runs, "ref_offload") == _curve(runs, "ref")  # same _C kernel, same floats


@pytest.mark.parametrize("name", list(RUNS))
def test_offload_loss_curve_matches_single_process(runs, name):
    want, got = _curve(runs, "ref"), _curve(runs, name)
    assert len(got) == len(want) == DP_STEPS
    assert [g["loss"] for g in got] == pytest.approx([w["loss"] for w in want], rel=RTOL), name
    assert [g["grad_norm"] for g in got] == pytest.approx([w["grad_norm"] for w in want], rel=RTOL), name


def test_offload_resume_is_bitwise(runs):
    """Stopped after 5 steps and resumed: the host masters and moments came back exactly."""
    assert _curve(runs, f"{RESUMED}_resumed") == _curve(runs, RESUMED)


def _summary(root, name):
    with open(os.path.join(root, name, "summary.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", ["ref_offload", *RUNS])
def test_memory_moves_optimizer_state_to_host(runs, name):
    """Device: params 4 (/dp at zero 3), grads 4 (/dp from zero 2), no optimizer state.
    Host: masters + moments 12 and grad copies 4 bytes/param, /dp from zero 1 (the owned
    chunks). Bucket padding to a multiple of dp is the only excess, hence 5%."""
    s = _summary(runs, name)
    psi, dp, zero = s["params"], s["dp"], s["zero"]
    shard = dp if zero >= 1 else 1
    got = s["memory_bytes"]
    want = {"params": 4 * psi / (dp if zero >= 3 else 1), "grads": 4 * psi / (dp if zero >= 2 else 1)}
    for kind in want:
        assert got[kind] == pytest.approx(want[kind], rel=0.05), (name, kind, got)
    assert got["optimizer"] == 0
    assert got["host"]["optimizer"] == pytest.approx(12 * psi / shard, rel=0.05), (name, got)
    assert got["host"]["grads"] == pytest.approx(4 * psi / shard, rel=0.05), (name, got)
    ref = _summary(runs, "ref")["memory_bytes"]
    assert ref["host"] == {"params": 0, "grads": 0, "optimizer": 0} and ref["optimizer"] == 8 * psi


def test_offload_config_errors_name_the_fix():
    assert validate(dp_config(dp=2, zero=2, offload="cpu"), 2) == []
    for fused in ("torch", "triton", "cuda"):
        cfg = dp_config(dp=2, zero=1, offload="cpu")
        cfg.optim.fused = fused
        assert any(f"parallel.offload=cpu updates on the host, where optim.fused={fused}" in p and "fix:" in p
                   for p in validate(cfg, 2)), fused
    assert any("parallel.offload='gpu' is unknown; fix: none or cpu" in p
               for p in validate(dp_config(dp=2, offload="gpu"), 2))


def _optimizer_pair(device, zero):
    """The same seeded model twice: an on-device and an offloaded optimizer (dp=1)."""
    out = []
    for offload in ("none", "cpu"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(37, 53), nn.LayerNorm(53), nn.Linear(53, 5)).to(device)
        cfg = OptimConfig(weight_decay=0.1)
        grid = ParallelGrid.single(device)
        flat, opt, _ = build_optimizer(model, cfg, zero=zero, bucket_mb=0.001, grid=grid, offload=offload)
        out.append((flat, opt))
    return out


def _check_pair(device, zero):
    (flat_a, opt_a), (flat_b, opt_b) = _optimizer_pair(device, zero)
    for step in range(3):
        torch.manual_seed(100 + step)
        for ga, gb in zip(opt_a.grads, opt_b.grads):
            g = torch.randn_like(ga)
            ga.copy_(g)
            gb.copy_(g)
        opt_a.step(1e-2)
        opt_b.step(1e-2)
    for a, b in zip(flat_a.groups, flat_b.groups):
        assert a.data.device.type == b.data.device.type == torch.device(device).type
        # CPU: the same _C kernel bitwise; CUDA: the device kernel vs _C, fp32 rounding
        torch.testing.assert_close(b.data, a.data, rtol=0 if device == "cpu" else 1e-6,
                                   atol=0 if device == "cpu" else 1e-7)
    for m in opt_b.exp_avg + opt_b.exp_avg_sq + opt_b.host.masters:
        assert m.device.type == "cpu" and m.is_pinned() == (torch.device(device).type == "cuda")


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_offloaded_optimizer_equals_on_device_cpu(zero):
    _check_pair("cpu", zero)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned memory, non_blocking copies)")
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_offloaded_optimizer_pinned_non_blocking_cuda(zero):
    _check_pair("cuda", zero)
