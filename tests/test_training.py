"""Training gives the same loss curve under every parallel config as one process."""
import os

import pytest
from multirank import spawn
from train_cases import PARALLEL_RUNS, read_metrics, read_rows, train_parallel_runs, train_single

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)

# fp32: tp/dp reorder the sums inside matmuls and reductions, so losses agree to
# rounding, compounded over 20 AdamW steps; 1e-5 relative is the bound.
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("train"))
    train_single(os.path.join(root, "single"))
    train_single(os.path.join(root, "accum"), micro=2)  # 8 micro-batches per step
    spawn(2, train_parallel_runs, root)
    return root


def test_reference_run_learns(runs):
    losses, evals = read_metrics(os.path.join(runs, "single"))
    assert len(losses) == 20
    assert losses[-1] < losses[0] - 0.3, losses  # the loss falls
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 20  # eval before any update, and at the end
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(0.0 <= e["eval_accuracy"] <= 1.0 for e in evals)


@pytest.mark.parametrize("name", ["accum"] + [r[0] for r in PARALLEL_RUNS])
def test_loss_curve_matches_single_process(runs, name):
    want, want_eval = read_metrics(os.path.join(runs, "single"))
    got, got_eval = read_metrics(os.path.join(runs, name))
    assert len(got) == len(want) == 20
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g == pytest.approx(w, rel=RTOL), f"{name} step {step}: {g} vs {w}"
    for g, w in zip(got_eval, want_eval):
        assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=RTOL), name
        assert g["eval_accuracy"] == w["eval_accuracy"], name  # same greedy decodes


@pytest.mark.parametrize("name", [r[0] for r in PARALLEL_RUNS])
def test_grad_norm_matches_single_process(runs, name):
    """Clipping sees the full model's norm: tp shards summed, replicated norms counted once."""
    want = [r["grad_norm"] for r in read_rows(os.path.join(runs, "single")) if "grad_norm" in r]
    got = [r["grad_norm"] for r in read_rows(os.path.join(runs, name)) if "grad_norm" in r]
    assert len(got) == len(want) == 20
    assert got == pytest.approx(want, rel=RTOL)
    assert want[0] > 1.0  # clip_grad=1.0 really clips at the start


def test_bf16_tracks_fp32(runs, tmp_path):
    """bf16 autocast changes rounding, not the math: the first steps stay within 2%
    of fp32 (bf16 has an 8-bit mantissa, ~0.4% per op) while weights stay fp32."""
    from train_cases import train_single_bf16

    train_single_bf16(str(tmp_path))
    got, _ = read_metrics(str(tmp_path))
    want, _ = read_metrics(os.path.join(runs, "single"))
    assert len(got) == 5
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=2e-2)
    assert got != want[:5]  # bf16 really ran (exact equality would mean fp32 compute)


@pytest.mark.parametrize("name, world, dp, accumulation", [
    ("single", 1, 1, 2), ("accum", 1, 1, 8), ("tp2", 2, 1, 2), ("dp2", 2, 2, 2)])
def test_config_yaml_is_the_config_that_ran(runs, name, world, dp, accumulation):
    """RUN_DIR/config.yaml: the run's (resolved) config with dp as the grid had it, and what
    it implied: the world size and the micro-batches per rank per step."""
    from train_cases import PARALLEL_RUNS, small_config

    from megaft.training.run_config import read_run_config

    micro = {"single": 8, "accum": 2, **{r[0]: r[4] for r in PARALLEL_RUNS}}[name]
    want = small_config(micro=micro)
    for run_name, tp, run_dp, sp, _ in PARALLEL_RUNS:
        if run_name == name:
            want.parallel.tp, want.parallel.dp, want.parallel.sequence_parallel = tp, run_dp, sp
    want.parallel.dp = dp  # None in the single-process configs: the grid's
    ran = read_run_config(os.path.join(runs, name))
    assert ran.config == want and (ran.world_size, ran.accumulation_steps) == (world, accumulation)


def _parts(tmp_path, precision="fp32"):
    """The parts of a one-process run of small_config (megaft.training.parts.TrainSpec)."""
    import torch
    from train_cases import small_config

    from megaft.parallel.grid import ParallelGrid
    from megaft.training.parts import TrainSpec

    cfg = small_config(steps=4, micro=4)
    cfg.precision = precision
    torch.manual_seed(0)
    return TrainSpec().build(cfg, ParallelGrid.single(), str(tmp_path))


def test_optimizer_part_takes_the_whole_step(tmp_path):
    """OptimParts.step(lr) after a backward: the clipped update with the global grad norm,
    then zeroed gradients; its public surface is all the loop needs."""
    import torch

    parts = _parts(tmp_path)
    batch = parts.data.batch(0)
    assert len(batch.inputs) == 4 and batch.tokens == 16 * 32 and batch.n_targets > 0  # global 16, micro 4
    parts.step.forward_backward(batch, parts.optim.loss_divisor(batch.n_targets))
    params = [p for p in parts.model.parameters() if p.requires_grad]
    norm = torch.cat([p.grad.flatten() for p in params]).double().norm().float()
    before = [p.detach().clone() for p in params]
    stats = parts.optim.step(1e-3)
    assert stats.finite and stats.lr == 1e-3 and stats.scaler_record() == {}
    # the part sums fp32 squares per tensor (megaft.optim.clip): ~4e-6 from the fp64 norm here
    torch.testing.assert_close(stats.grad_norm, norm, rtol=1e-5, atol=0)
    assert all(not torch.equal(a, p) for a, p in zip(before, params))  # every parameter moved
    assert all(not p.grad.any() for p in params)  # ready for the next step's accumulation
    assert parts.optim.take_sent_bytes() == 0  # one process: nothing reduced
    state = parts.optim.capture(1)
    assert state["step"] == 1 and state["index"]  # names and offsets: a load can reshard


def test_optimizer_part_skips_an_overflowed_fp16_step(tmp_path):
    """fp16: the step's loss divisor carries the scale; an inf gradient skips the update on
    every rank, halves the scale and counts the skip, and the gradients are still zeroed."""
    import torch

    parts = _parts(tmp_path, "fp16")
    batch = parts.data.batch(0)
    scale = parts.optim.scaler.scale
    assert parts.optim.loss_divisor(batch.n_targets) == batch.n_targets / scale
    parts.step.forward_backward(batch, parts.optim.loss_divisor(batch.n_targets))
    params = [p for p in parts.model.parameters() if p.requires_grad]
    params[0].grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in params]
    stats = parts.optim.step(1e-3)
    assert not stats.finite and stats.scaler_record() == {"loss_scale": scale / 2, "skipped_steps": 1}
    assert all(torch.equal(a, p) for a, p in zip(before, params)) and not any(p.grad.any() for p in params)
