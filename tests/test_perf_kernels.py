"""Elementwise, norm and loss kernels by bytes over HBM, launch gaps, the eager host, and tp overlap
(megaft.perf.kernels_cost and megaft.perf.time, issue 42): each priced quantity against the tensors
it counts, and what the step does with them."""
import dataclasses
import os

import pytest
from omegaconf import OmegaConf

from megaft.config import Config
from megaft.config.cluster import ClusterConfig
from megaft.config.model import ModelConfig
from megaft.perf.kernels_cost import GEMM_KERNELS, KernelCosts, block_passes, host_s, loss_passes, pass_s
from megaft.perf.time import _stage_costs, step_cost
from megaft.plan.shape import check_cluster

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=640, vocab_size=1000, max_seq_len=512)


def preset(name: str) -> ClusterConfig:
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "cluster", f"{name}.yaml")))
    fields.pop("defaults")
    return ClusterConfig(**fields)


def run_config(*, seq: int = 512, micro: int = 1, tp: int = 1, sp: bool = False, **model) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(**{**SHAPE, **model})
    cfg.data.seq_len, cfg.precision = seq, "bf16"
    cfg.train.micro_batch_size = cfg.train.global_batch_size = micro
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, sp
    return cfg


def test_presets_price_kernels_and_bad_values_are_refused():
    h100 = preset("h100")
    kc = KernelCosts.of(h100, 3.35)
    assert kc.bandwidth == pytest.approx(0.90 * 3.35e12) and kc.gap == pytest.approx(1e-6) and kc.compiled
    assert kc.op_host == 0.0  # compiled: no eager dispatch
    assert KernelCosts.of(dataclasses.replace(h100, compiled=False), 3.35).op_host == pytest.approx(10e-6)
    assert KernelCosts.of(dataclasses.replace(h100, hbm_fraction=0.0), 3.35) is None  # not priced
    assert not h100.tp_overlap  # Megatron's overlap (megaft's own is parallel.tp_overlap=ring)
    bad = dataclasses.replace(h100, hbm_fraction=1.5, kernel_gap_us=-1.0)
    assert any("cluster.hbm_fraction=1.5" in p for p in check_cluster(bad, "bf16"))


def test_a_blocks_bytes_are_its_tensors_bytes():
    m, tokens, a = ModelConfig(**SHAPE), 512, 2
    stream, qk, ffn = tokens * m.dim, tokens * (m.n_heads + m.kv_heads) * m.hd, tokens * m.ffn_dim
    f, b = block_passes(m, 0, tokens, 1, False, a, compiled=True)
    # two norms read x and write y; two residual adds read two and write one; rotary reads and writes
    # q and k; the activation reads gate and up and writes their product
    assert f.nbytes == 2 * 2 * a * stream + 2 * 3 * a * stream + 2 * a * qk + 3 * a * ffn
    assert f.act_bytes == 3 * a * ffn
    assert b.nbytes == 2 * 3 * a * stream + 2 * 3 * a * stream + 2 * a * qk + 5 * a * ffn
    assert (f.kernels, b.kernels) == (GEMM_KERNELS[0] + 7, GEMM_KERNELS[1] + 7)
    # tp splits the heads and the ffn columns; sequence parallelism also the residual stream
    f2, _ = block_passes(m, 0, tokens, 2, False, a, compiled=True)
    f2sp, _ = block_passes(m, 0, tokens, 2, True, a, compiled=True)
    assert f2.nbytes == 2 * 2 * a * stream + 2 * 3 * a * stream + (2 * a * qk + 3 * a * ffn) / 2
    assert f2sp.nbytes == f.nbytes / 2
    # eager: the fp32 norm (6 kernels, 4a + 28 bytes per element) and rotary through fp32 complex numbers
    e, _ = block_passes(m, 0, tokens, 1, False, a, compiled=False)
    assert e.nbytes == 2 * (4 * a + 28) * stream + 2 * 3 * a * stream + (2 * a + 16) * qk + 5 * a * ffn
    assert e.kernels == GEMM_KERNELS[0] + 2 * 6 + 2 + 6 + 2


def test_the_loss_reads_and_writes_the_logits():
    m = ModelConfig(**SHAPE)
    f, b = loss_passes(m, 512, 2, 2, compiled=True)  # Megatron's vocab-parallel cross-entropy
    logits = 512 * 500
    assert (f.nbytes, b.nbytes) == (logits * (2 + 36), logits * (12 + 2))
    f, b = loss_passes(m, 512, 1, 2, compiled=False)  # torch's cross_entropy on logits.float()
    assert (f.nbytes, b.nbytes) == (1000 * 512 * 18, 1000 * 512 * 22)


def test_the_step_adds_exactly_the_kernels_seconds():
    cfg, h100 = run_config(), preset("h100")
    before = dataclasses.replace(h100, hbm_fraction=0.0)
    kc = KernelCosts.of(h100, 3.35)
    m, tokens = cfg.model, 512
    f, b = block_passes(m, 0, tokens, 1, False, 2, compiled=True)
    lf, lb = loss_passes(m, tokens, 1, 2, compiled=True)
    added = m.n_layers * (pass_s(f, kc) + pass_s(b, kc)) + pass_s(lf, kc) + pass_s(lb, kc)
    assert added > 0
    assert step_cost(cfg, h100, 1).terms["compute"] == pytest.approx(
        step_cost(cfg, before, 1).terms["compute"] + added, rel=1e-12)


def test_an_eager_block_waits_on_its_host_only_where_the_host_is_slower():
    h100 = preset("h100")
    eager = dataclasses.replace(h100, compiled=False)
    kc = KernelCosts.of(eager, 3.35)
    # a tiny block (8 tokens): the GPU finishes each pass before the host has dispatched it, so a
    # pass takes exactly the host's time: its ops times eager_op_us
    tiny = run_config(seq=8)
    f, b = block_passes(tiny.model, 0, 8, 1, False, 2, compiled=False)
    stage = _stage_costs(tiny, eager, 1)[0]
    _, lb = loss_passes(tiny.model, 8, 1, 2, compiled=False)
    head_f = stage["f_compute"] - tiny.model.n_layers * host_s(f, kc)
    assert host_s(f, kc) == pytest.approx(f.kernels * 10e-6, rel=1e-12)
    assert 0 < head_f < host_s(f, kc)  # the rest is the head and the loss, priced on the GPU
    assert stage["b_compute"] - tiny.model.n_layers * host_s(b, kc) > pass_s(lb, kc)
    # a long sequence: the GPU is slower than the host, which then shows nowhere
    big = run_config(seq=4096, micro=4)
    slow_host = dataclasses.replace(eager, eager_op_us=0.0)
    assert _stage_costs(big, eager, 1) == _stage_costs(big, slow_host, 1)


def test_tp_overlap_hides_the_blocks_collectives_behind_their_gemms():
    h100 = preset("h100")
    on = dataclasses.replace(h100, tp_overlap=True)
    cfg = run_config(seq=4096, micro=2, tp=8, sp=True, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336)
    off_stage, on_stage = _stage_costs(cfg, h100, 1)[0], _stage_costs(cfg, on, 1)[0]
    assert on_stage["f_compute"] == off_stage["f_compute"]  # the GEMMs are not slowed (not modelled)
    assert 0 < on_stage["f_tp"] < off_stage["f_tp"] and 0 < on_stage["b_tp"] < off_stage["b_tp"]
    # at tp = 1 there is nothing to hide: the same step
    assert step_cost(run_config(), on, 1).terms == step_cost(run_config(), h100, 1).terms


def test_ring_overlap_hides_less_than_megatrons_and_all_on_a_fast_link():
    # parallel.tp_overlap=ring (megaft's runtime): each ring step hides behind one chunk's GEMM, so it shows
    # between none and Megatron's (whole GEMMs: cluster.tp_overlap) and, when every chunk's GEMM outlasts
    # its transfer, hides as much as Megatron's; the compute is untouched and without sp there is no ring
    h100 = preset("h100")
    fast = dataclasses.replace(h100, nvlink_gbps=1e6, nvlink_latency_us=0.0)
    for tp in (2, 8):
        cfg = run_config(seq=4096, micro=2, tp=tp, sp=True, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336)
        off = _stage_costs(cfg, h100, 1)[0]
        cfg.parallel.tp_overlap = "ring"
        ring = _stage_costs(cfg, h100, 1)[0]
        megatron = _stage_costs(cfg, dataclasses.replace(h100, tp_overlap=True), 1)[0]
        assert ring["f_compute"] == off["f_compute"] and ring["b_compute"] == off["b_compute"]
        for key in ("f_tp", "b_tp"):
            assert megatron[key] < ring[key] < off[key], (tp, key)
        ring_fast = _stage_costs(cfg, fast, 1)[0]
        megatron_fast = _stage_costs(cfg, dataclasses.replace(fast, tp_overlap=True), 1)[0]
        assert (ring_fast["f_tp"], ring_fast["b_tp"]) == (megatron_fast["f_tp"], megatron_fast["b_tp"])
        cfg.parallel.sequence_parallel = False
        assert _stage_costs(cfg, h100, 1)[0]["f_tp"] > ring["f_tp"]


def test_dp_overlap_hides_the_reduction_and_the_gather_as_megatron_does():
    # cluster.dp_overlap (Megatron's --overlap-grad-reduce --overlap-param-gather): at pp > 1 the ZeRO-1
    # reduce-scatter hides behind the fullest pp rank's last micro-batch backward (at least one bucket shows),
    # and the parameter all-gather behind its first micro-batch forward; the rest of the step is untouched
    from megaft.config.train import accumulation_steps
    from megaft.perf.counts import trainable_rank_params
    from megaft.perf.rates import gather_s, group_link
    from megaft.perf.time import MIB, _layout

    h100 = preset("h100")
    on = dataclasses.replace(h100, dp_overlap=True)
    for pp, zero in ((1, 1), (2, 1), (2, 2)):
        cfg = run_config(seq=4096, micro=1, dim=2048, n_heads=16, n_kv_heads=4, ffn_dim=5632, vocab_size=32000)
        cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = pp, 16, zero
        cfg.train.global_batch_size = 64
        world = 16 * pp
        off_cost, on_cost = step_cost(cfg, h100, world), step_cost(cfg, on, world)
        lay = _layout(cfg, h100, world)
        assert accumulation_steps(cfg.train, 16) == 4
        ranks = trainable_rank_params(cfg.model, cfg.parallel, cfg.lora)
        r = ranks.index(max(ranks))  # the fullest pp rank (pp 2: the head's, the final norm beside it)
        last_b, first_f = lay.b[r], lay.f[r]
        link = group_link(h100, 16, 1)
        for term, full, hidden_by, nbytes in (("dp_comm", off_cost.terms["dp_comm"], last_b, 4),
                                              ("param_gather", off_cost.terms["param_gather"], first_f, 2)):
            if term == "dp_comm" and (zero == 2 or pp == 1):
                continue  # ZeRO-2 reduces per micro-batch (zero_comm); pp = 1 hides it either way
            assert full > 0
            bucket = gather_s(cfg.parallel.bucket_mb * MIB, 16, link)
            assert on_cost.terms[term] == pytest.approx(max(bucket, full - hidden_by), rel=1e-12), (pp, zero, term)
            assert on_cost.terms[term] < full
        for term in ("compute", "tp_comm", "pp_bubble", "zero_comm", "optimizer"):
            assert on_cost.terms[term] == off_cost.terms[term]
