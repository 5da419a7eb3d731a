"""The attention core by a flash kernel's causal curve (megaft.perf.attention, issue 42): the preset's
published points priced exactly, log-linear between them, the nearest outside; a layout's core at the
sequence of each kernel call (cp shortens it); the step's compute moves by exactly the core's change."""
from __future__ import annotations

import dataclasses

import pytest
from test_perf_head import h100
from test_plan import checkpoint, composed

from megaft.config.train import accumulation_steps
from megaft.perf.attention import AttentionCurve
from megaft.perf.counts import attention_core_flops
from megaft.perf.rates import compute_rates
from megaft.perf.time import step_cost
from megaft.plan.shape import check_cluster, planning_config

NO_CURVE = dict(attention_seq=[], attention_fwd_tflops=[], attention_fwd_causal_tflops=[], attention_bwd_tflops=[])


def test_the_published_points_are_priced_as_published():
    c = h100()
    curve = AttentionCurve.of(c, "bf16")
    flops = 3.0e12
    for s, fwd, causal, bwd in zip(c.attention_seq, c.attention_fwd_tflops, c.attention_fwd_causal_tflops,
                                   c.attention_bwd_tflops):
        f, b = curve.core_s(flops, s)
        assert f == pytest.approx(flops / 2 / (causal * 1e12), rel=1e-12)  # causal: half the whole rows
        assert b == pytest.approx(2.5 * flops / 2 / (bwd * 1e12 * causal / fwd), rel=1e-12)
    # between two lengths: linear in log2(s); outside: the nearest point
    mid = curve.core_s(flops, 2896)[0]  # ~2^11.5, halfway between 2k and 4k
    assert flops / 2 / mid / 1e12 == pytest.approx((298 + 319) / 2, rel=1e-3)
    assert curve.core_s(flops, 256) == curve.core_s(flops, 512)
    assert curve.core_s(flops, 65536) == curve.core_s(flops, 16384)
    # the kernel gets faster with the sequence: the per-FLOP time never grows
    times = [sum(curve.core_s(flops, s)) for s in (512, 700, 1024, 3000, 4096, 10000, 16384)]
    assert times == sorted(times, reverse=True)
    assert AttentionCurve.of(c, "fp32") is None  # the rates are bf16's
    assert AttentionCurve.of(dataclasses.replace(c, **NO_CURVE), "bf16") is None


@pytest.mark.parametrize("cp", [1, 2])
def test_the_step_prices_the_core_by_the_curve(tmp_path, cp):
    """8B at seq 8192 on one node: the compute term moves from the core at matmul_fraction (forward once,
    backward twice) to the curve's forward and backward at the kernel's sequence, seq/cp, exactly."""
    cfg = composed([f"model.init_from={checkpoint(tmp_path, '8B')}", "cluster=h100", "data.seq_len=8192",
                    "model.max_seq_len=8192", "train.global_batch_size=16", "precision=bf16", "parallel.tp=2",
                    f"parallel.cp={cp}", "parallel.zero=1", "train.micro_batch_size=1", "model.recompute=none"])
    shaped, problems = planning_config(cfg)
    assert problems == []
    c = shaped.cluster
    m, world = shaped.model, 8
    dp = world // (2 * cp)
    tokens = cfg.train.micro_batch_size * 8192 // cp
    flops = tokens * attention_core_flops(m, 8192) / 2
    rate = compute_rates(c, "bf16").rate
    att_f, att_b = AttentionCurve.of(c, "bf16").core_s(flops, 8192 // cp)
    micro = accumulation_steps(cfg.train, dp)
    with_curve = step_cost(shaped, c, world).terms["compute"]
    without = step_cost(shaped, dataclasses.replace(c, **NO_CURVE), world).terms["compute"]
    assert with_curve - without == pytest.approx(micro * m.n_layers * (att_f + att_b - 3 * flops / rate), rel=1e-6)
    assert with_curve > without  # FlashAttention-2's causal backward is slower than 0.7 of the peak


def test_a_broken_curve_is_refused_with_the_fix():
    bad = dataclasses.replace(h100(), attention_fwd_tflops=[309, 350])
    problems = check_cluster(bad, "bf16")
    assert any(p.startswith("cluster.attention_seq=[512, 1024") and "fix: " in p for p in problems), problems
    assert check_cluster(dataclasses.replace(h100(), **NO_CURVE), "bf16") == []


def test_a_power_capped_part_runs_the_curve_at_its_clock():
    # torchtitan's 500 W H100s: a peak below the datasheet's (here the H100 NVL's 835, the footnote's lower
    # bound) slows the measured curve by the same ratio, as it slows the GEMM curve; the HBM-bound kernels
    # and the launch gaps stay; a peak equal to the datasheet's changes nothing
    from megaft.perf.hardware import peak_ratio
    from megaft.perf.kernels_cost import Pass, pass_s

    c = h100()
    capped = dataclasses.replace(c, peak_tflops_bf16=835.0)
    assert peak_ratio(capped, "bf16") == pytest.approx(835.0 / 989.4, rel=1e-12)
    assert peak_ratio(capped, "fp16") == 1.0  # only the precision it sets
    assert peak_ratio(dataclasses.replace(c, peak_tflops_bf16=989.4), "bf16") == 1.0
    flops = 3.0e12
    for s in (512, 3000, 8192):
        base, slow = AttentionCurve.of(c, "bf16").core_s(flops, s), AttentionCurve.of(capped, "bf16").core_s(flops, s)
        for x, y in zip(base, slow):
            assert y == pytest.approx(x * 989.4 / 835.0, rel=1e-12)
    base, slow = compute_rates(c, "bf16"), compute_rates(capped, "bf16")
    assert slow.rate == pytest.approx(base.rate * 835.0 / 989.4, rel=1e-12)
    assert slow.curve.peak == pytest.approx(base.curve.peak * 835.0 / 989.4, rel=1e-12)
    assert slow.curve.hbm == base.curve.hbm
    p = Pass(1e9, 40, 0.0)
    assert pass_s(p, slow.kernels) == pass_s(p, base.kernels)
