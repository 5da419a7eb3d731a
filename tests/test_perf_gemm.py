"""GEMM efficiency by shape (megaft.perf.gemm, issue 42): wave quantization, the HBM bound, grouped
GEMMs sharing waves, a block's linears against its FLOP count, and what the planner does with it."""
import dataclasses
import os

import pytest
from omegaconf import OmegaConf

from megaft.config.cluster import ClusterConfig
from megaft.config.model import ModelConfig
from megaft.perf.counts import attention_core_flops, layer_forward_flops
from megaft.perf.gemm import GemmCurve, Linear, block_linears, efficiency, gemm_s, linear_s
from megaft.perf.hardware import cluster_hbm_tbps, cluster_peak_tflops
from megaft.plan.shape import check_cluster

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def preset(name: str) -> ClusterConfig:
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "cluster", f"{name}.yaml")))
    fields.pop("defaults")
    return ClusterConfig(**fields)


def h100_curve(precision: str = "bf16"):
    c = preset("h100")
    return GemmCurve.of(c, precision, cluster_peak_tflops(c, precision), cluster_hbm_tbps(c))


def test_presets_carry_a_curve_or_none():
    curve = h100_curve()
    assert (curve.ceiling, curve.sms, curve.tile_m, curve.tile_n, curve.element_bytes) == (0.80, 132, 128, 256, 2)
    assert GemmCurve.of(preset("a100"), "bf16", 312.0, 2.039).sms == 108
    for name in ("b200", "cpu"):  # no published GEMM numbers used: every FLOP at matmul_fraction
        assert GemmCurve.of(preset(name), "bf16", 1.0, 1.0) is None
    assert GemmCurve.of(preset("h100"), "fp32", 66.9, 3.35) is None  # the ceiling is bf16's
    assert GemmCurve.of(preset("h100"), "fp16", 989.4, 3.35) == h100_curve()
    bad = dataclasses.replace(preset("h100"), gemm_ceiling=1.5)
    assert any("cluster.gemm_ceiling=1.5" in p for p in check_cluster(bad, "bf16"))


def test_full_waves_run_at_the_ceiling_and_a_spare_tile_costs_a_wave():
    curve = h100_curve()
    m, n, k = 12 * 128, 11 * 256, 8192  # 132 tiles: one full wave, compute-bound
    assert efficiency(m, n, k, curve) == pytest.approx(curve.ceiling, rel=1e-12)
    assert efficiency(2 * m, n, k, curve) == pytest.approx(curve.ceiling, rel=1e-12)  # two full waves
    # one more row of tiles (11 more tiles): a second wave, priced whole
    assert efficiency(m + 128, n, k, curve) == pytest.approx(curve.ceiling * 143 / 264, rel=1e-12)
    # small GEMMs fall far below the peak: 1024^3 fills 32 of 132 SMs
    assert efficiency(1024, 1024, 1024, curve) < 0.25 < curve.ceiling
    assert efficiency(1024, 1024, 1024, curve) < efficiency(4096, 4096, 4096, curve) < efficiency(8192, 8192, 8192,
                                                                                                   curve) + 1e-12


def test_skinny_gemms_are_bound_by_hbm():
    curve = h100_curve()
    m, n, k = 16, 132 * 256, 8192  # a few rows across a full wave: reading B dominates
    assert gemm_s(m, n, k, curve) == pytest.approx((m * k + k * n + m * n) * 2 / curve.hbm, rel=1e-12)
    assert gemm_s(0, n, k, curve) == 0.0


def test_a_grouped_gemm_shares_its_waves():
    """8 experts of 16 tiles each fill one wave together (megaft.kernels.grouped_gemm), as 8
    separate GEMMs would take 8 waves."""
    curve = h100_curve()
    one = gemm_s(4 * 128, 4 * 256, 4096, curve)
    assert gemm_s(4 * 128, 4 * 256, 4096, curve, groups=8) == pytest.approx(one, rel=1e-12)
    assert gemm_s(4 * 128, 4 * 256, 4096, curve, groups=9) == pytest.approx(2 * one, rel=1e-12)


def test_linear_prices_forward_and_both_gradients():
    curve = h100_curve()
    lin = Linear(rows=4096, n_in=2048, n_out=6144)
    f, d, w = linear_s(lin, curve)
    assert f == gemm_s(4096, 6144, 2048, curve) and d == gemm_s(4096, 2048, 6144, curve)
    assert w == gemm_s(6144, 2048, 4096, curve)  # the weight gradient's depth is the tokens
    assert lin.flops == 2.0 * 4096 * 2048 * 6144


LLAMA_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)


def test_block_linears_hold_every_linear_flop():
    """A dense block's linears are its FLOPs less the attention core, split by tp; a mixture's
    local experts hold their share of the ep group's top_k rows."""
    m, tokens, seq = ModelConfig(**LLAMA_8B), 4096, 4096
    for tp in (1, 2, 8):
        listed = sum(lin.flops for lin in block_linears(m, 0, tokens, tp))
        assert listed == pytest.approx(tokens * (layer_forward_flops(m, seq, 0) - attention_core_flops(m, seq)) / tp,
                                       rel=1e-12)
    moe = ModelConfig(**{**LLAMA_8B, "n_experts": 8, "top_k": 2})
    for ep in (1, 2, 4):
        experts = [lin for lin in block_linears(moe, 0, tokens, 1, ep) if lin.count > 1]
        assert [lin.count for lin in experts] == [8 // ep] * 2
        assert experts[0].rows * experts[0].count == tokens * 2  # every local expert's rows: the rank's top_k rows


def test_tp_narrows_the_gemms_and_costs_efficiency():
    """Why the planner's rankings moved (docs/plan-and-scale.md): at 4096 tokens Llama-8B's block
    GEMMs lose waves as tp narrows them, so a FLOP under tp=8 costs more than under tp=1."""
    m, curve = ModelConfig(**LLAMA_8B), h100_curve()

    def per_flop(tp: int) -> float:
        lins = block_linears(m, 0, 4096, tp)
        return sum(sum(linear_s(lin, curve)) for lin in lins) / sum(3 * lin.flops for lin in lins)

    assert per_flop(1) < per_flop(8)
    assert 1 / (per_flop(1) * curve.peak) > 0.7  # the 8B block's GEMMs near the ceiling at tp=1
