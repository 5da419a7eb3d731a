"""Training gives the same loss curve under every parallel config as one process."""
import os

import pytest
from multirank import spawn
from train_cases import PARALLEL_RUNS, read_metrics, read_rows, train_parallel_runs, train_single

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
