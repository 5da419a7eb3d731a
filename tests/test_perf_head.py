"""A reward model's head in the time model (megaft.perf.head, issue 42): train.objective=reward prices
the scalar `score` the run builds, not an LM head's GEMMs, cross-entropy and collectives; the FLOP
count (MFU) and the parameter count are the modules'."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from omegaconf import OmegaConf
from test_estimate import CONF, preset_1b
from torch.utils.flop_counter import FlopCounterMode

from megaft.config.cluster import ClusterConfig
from megaft.config.model import ModelConfig
from megaft.config.train import accumulation_steps
from megaft.models.decoder import Decoder
from megaft.perf.counts import flops_per_token, matmul_params, rank_params, total_params
from megaft.perf.rates import all_reduce_s, gather_s, group_link
from megaft.perf.time import step_cost


def h100(**changes) -> ClusterConfig:
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "cluster", "h100.yaml")))
    fields.pop("defaults")
    return dataclasses.replace(ClusterConfig(**fields), **changes)


# one rate per FLOP (no GEMM curve) and no elementwise kernels: every head FLOP at peak x matmul_fraction
FLAT = dict(gemm_sms=0, hbm_fraction=0.0)


def pair(objective: str, tp: int = 1, sp: bool = False):
    """The 1B preset at dp = 8 / tp, zero 1, on 8 ranks: a reward model, or DPO's pairs (the same two
    rows a micro-batch through an LM head) with a reference scored before training."""
    cfg = preset_1b(micro=2)
    cfg.train.objective, cfg.pref.reference_mode = objective, "precompute"
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.zero, cfg.parallel.sequence_parallel = tp, 8 // tp, 1, sp
    return cfg


def test_the_reward_head_is_one_score_a_token_not_the_vocabulary():
    """At one rate per FLOP the reward step computes exactly the LM head's FLOPs less (forward, input and
    weight gradient: 3 x 2 x tokens x dim x (vocab - 1) a micro-batch); with the GEMM curve and the
    kernels by bytes it also drops the cross-entropy's bytes, so the gap only grows."""
    reward, dpo = pair("reward"), pair("dpo")
    m, flat = dpo.model, h100(**FLAT)
    micro = accumulation_steps(dpo.train, 8)
    tokens = 2 * dpo.train.micro_batch_size * dpo.data.seq_len
    rate = 989.4e12 * flat.matmul_fraction
    gap = step_cost(dpo, flat, 8).terms["compute"] - step_cost(reward, flat, 8).terms["compute"]
    assert gap == pytest.approx(micro * 3 * tokens * 2.0 * m.dim * (m.vocab_size - 1) / rate, rel=1e-9)
    full = step_cost(dpo, h100(), 8).terms["compute"] - step_cost(reward, h100(), 8).terms["compute"]
    assert full > gap * 1.05  # the 128k-wide cross-entropy's ~50 bytes a logit over HBM
    # the same rows through either head: the blocks cost the same, so the reward step is the smaller
    assert step_cost(reward, h100(), 8).step_s < step_cost(dpo, h100(), 8).step_s


def test_the_reward_head_has_no_vocab_parallel_collectives():
    """tp = 2 with sequence parallelism: the LM head's input all-gather, the cross-entropy's three fp32
    all-reduces and the input gradient's reduce-scatter are gone; the scores' fp32 all-gather comes in."""
    reward, dpo = pair("reward", tp=2, sp=True), pair("dpo", tp=2, sp=True)
    cluster = h100(**FLAT)
    link = group_link(cluster, 2)
    tokens = 2 * dpo.train.micro_batch_size * dpo.data.seq_len
    micro = accumulation_steps(dpo.train, 4)
    one = all_reduce_s(tokens * dpo.model.dim * 2, 2, link)  # bf16 activations: RS + AG, the bytes of an AR
    lm = one + 3 * all_reduce_s(tokens * 4, 2, link) + one
    score = gather_s(tokens * 4, 2, link)
    gap = step_cost(dpo, cluster, 8).terms["tp_comm"] - step_cost(reward, cluster, 8).terms["tp_comm"]
    assert gap == pytest.approx(micro * (lm - score), rel=1e-9)


def test_the_reward_model_trains_and_counts_its_own_parameters():
    """The optimizer's bytes are the reward model's parameters (no LM head), and the step's FLOPs per
    token (MFU) count the score, as the trainer's own count of the model it builds."""
    reward, sft = pair("reward"), pair("sft")
    reward.model.tie_embeddings = sft.model.tie_embeddings = False  # an LM head of its own (1B ties it)
    cluster = h100()
    got, lm = step_cost(reward, cluster, 8), step_cost(sft, cluster, 8)
    scored = dataclasses.replace(reward.model, score_head=True)
    share = rank_params(scored, tp=1, pp=1, vpp=1)[0] / rank_params(sft.model, tp=1, pp=1, vpp=1)[0]
    assert got.terms["optimizer"] == pytest.approx(lm.terms["optimizer"] * share, rel=1e-12) and share < 0.85
    assert got.flops_per_token == flops_per_token(scored, reward.data.seq_len)
    assert lm.flops_per_token - got.flops_per_token == 6.0 * sft.model.dim * (sft.model.vocab_size - 1)


@pytest.mark.parametrize("tie", [False, True])
def test_the_counts_are_the_modules(tie):
    """total_params is the built reward model's parameter count, and its forward's counted FLOPs
    (FlopCounterMode; the CPU attention kernel is not counted, in either model) are the LM model's less
    2 x tokens x dim x (vocab - 1): matmul_params' head term."""
    m = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=96, max_seq_len=32,
                    tie_embeddings=tie, score_head=True)
    lm = dataclasses.replace(m, score_head=False)
    ids = torch.randint(0, 96, (2, 16))
    flops = {}
    for name, cfg in (("reward", m), ("lm", lm)):
        torch.manual_seed(0)
        model = Decoder(cfg)
        assert total_params(cfg) == sum(p.numel() for p in model.parameters()), name
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(ids)
        flops[name] = counter.get_total_flops()
    assert flops["lm"] - flops["reward"] == 2 * ids.numel() * 32 * (96 - 1) == 2 * ids.numel() * (
        matmul_params(lm) - matmul_params(m))


def test_tied_embedding_grads_meet_across_the_pipeline():
    # megaft.pipeline.stage.sync_tied_grads all-reduces the tied weight's grad between the first and the last
    # pp rank after the schedule: vocab/tp x dim gradient elements, over the link of two ranks (pp-1)*tp*dp
    # apart; with dp = 1 it is all of dp_comm. Nothing at pp = 1, untied, or under LoRA (a frozen embedding).
    def cfg_of(tp: int, pp: int, tie: bool = True, lora: int = 0):
        cfg = preset_1b(micro=1)
        cfg.model.tie_embeddings = tie
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = tp, pp, 1, 1
        cfg.lora.rank = lora
        return cfg

    c = h100()
    m = preset_1b().model
    assert m.tie_embeddings
    for tp, pp in ((1, 2), (2, 2), (8, 2)):
        world = tp * pp
        link = group_link(c, 2, (pp - 1) * tp)
        assert (link.latency == c.ib_latency_us * 1e-6) == (tp * pp > c.gpus_per_node)  # 8 x 2: across nodes
        expected = all_reduce_s(-(-m.vocab_size // tp) * m.dim * 4, 2, link)
        assert step_cost(cfg_of(tp, pp), c, world).terms["dp_comm"] == pytest.approx(expected, rel=1e-12)
        assert step_cost(cfg_of(tp, pp, tie=False), c, world).terms["dp_comm"] == 0.0
        assert step_cost(cfg_of(tp, pp, lora=8), c, world).terms["dp_comm"] == 0.0
    assert step_cost(cfg_of(2, 1), c, 2).terms["dp_comm"] == 0.0
