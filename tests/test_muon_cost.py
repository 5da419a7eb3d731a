"""optim.name=muon in the cost model (megaft.perf.muon, megaft.perf.time): the Newton-Schulz
FLOPs formula equals what torch counts in megaft's orthogonalisation, the matrices are the ones
megaft gives Muon, and a layout's step prices the work and the gathers where they run."""
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
from megaft.models.decoder import Decoder
from megaft.optim.muon import muon_split, zeropower_via_newtonschulz
from megaft.perf.muon import hidden_matrices, ns_flops
from megaft.perf.time import step_cost


@pytest.mark.parametrize("shape", [(48, 48), (32, 80), (96, 40)])
def test_the_flops_formula_counts_megafts_newton_schulz(shape):
    with FlopCounterMode(display=False) as counter:
        zeropower_via_newtonschulz(torch.randn(*shape), 3.4445, -4.7750, 2.0315, 5, 1e-7)
    assert counter.get_total_flops() == ns_flops(*shape, 5)


@pytest.mark.parametrize("moe", [{}, dict(arch="qwen2_moe", n_experts=4, top_k=2, moe_ffn_dim=32,
                                          shared_expert_ffn_dim=48, shared_expert_gate=True)],
                         ids=["dense", "moe"])
def test_the_matrices_are_those_megaft_gives_muon(moe):
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, max_seq_len=32, **moe)
    muon = muon_split(Decoder(cfg))["muon"]
    shapes = [tuple(p.shape[-2:]) for p in muon.values() for _ in range(p.shape[0] if p.dim() == 3 else 1)]
    assert sorted(shapes) == sorted(hidden_matrices(cfg, 0))


def test_a_layout_prices_muons_work_and_gathers_where_they_run():
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "cluster", "h100.yaml")))
    fields.pop("defaults")
    cluster = ClusterConfig(**fields)

    def cost(name: str, **par):
        cfg = preset_1b(micro=1)
        cfg.optim.name = name
        cfg.parallel = dataclasses.replace(cfg.parallel, **par)
        return step_cost(cfg, cluster, cfg.parallel.tp * cfg.parallel.dp).terms

    adam, muon = cost("adamw", dp=8), cost("muon", dp=8)
    assert muon["optimizer"] > adam["optimizer"] and muon["compute"] == adam["compute"]
    # tp2: every tp rank orthogonalises whole matrices (no less work than tp1) and gathers the updates
    tp1, tp2 = cost("muon", tp=1, dp=2), cost("muon", tp=2, dp=2)
    adam_tp2 = cost("adamw", tp=2, dp=2)
    ns = tp1["optimizer"] - cost("adamw", tp=1, dp=2)["optimizer"]
    assert ns > 0 and tp2["optimizer"] - adam_tp2["optimizer"] == pytest.approx(ns, rel=1e-9)
    assert tp2["tp_comm"] > adam_tp2["tp_comm"]
    # ZeRO: each rank orthogonalises 1/dp of the matrices, after one more all-gather
    z0, z1 = cost("muon", dp=8, zero=0), cost("muon", dp=8, zero=1)
    assert z1["param_gather"] > cost("adamw", dp=8, zero=1)["param_gather"]
    assert (z0["optimizer"] - cost("adamw", dp=8, zero=0)["optimizer"]) == pytest.approx(
        8 * (z1["optimizer"] - cost("adamw", dp=8, zero=1)["optimizer"]), rel=1e-9)


@pytest.mark.parametrize("targets", [["q", "k", "v", "o", "gate", "up", "down"], ["q", "v", "down"]])
def test_under_lora_the_matrices_are_the_adapters_megaft_gives_muon(targets):
    """LoRA: the Muon matrices are the adapters' A and B (none of the frozen base's), and what tp
    gathers whole are the split halves (a column linear's B, a row linear's A), as megaft.peft.lora
    marks them; a 1B plan's Newton-Schulz term shrinks accordingly."""
    from megaft.config.lora import LoraConfig
    from megaft.parallel.tensor.shard import shard_of
    from megaft.peft.lora import apply_lora
    from megaft.perf.muon import tp_gathered

    lora = LoraConfig(rank=4, targets=targets)
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, max_seq_len=32)
    model = apply_lora(Decoder(cfg), lora, seed=0, tp_rank=0, tp_size=1)
    muon = muon_split(model)["muon"]
    assert sorted(tuple(p.shape) for p in muon.values()) == sorted(hidden_matrices(cfg, 0, lora=lora))
    assert len(muon) == 2 * len(targets)
    split = [tuple(p.shape) for p in muon.values() if shard_of(p) is not None]
    assert sorted(split) == sorted(tp_gathered(cfg, 0, lora=lora)) and len(split) == len(targets)
    full = preset_1b()
    full.optim.name = "muon"
    adapted = preset_1b()
    adapted.optim.name, adapted.lora.rank = "muon", 16
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "cluster", "h100.yaml")))
    fields.pop("defaults")
    cluster = ClusterConfig(**fields)
    a, b = step_cost(full, cluster, 8).terms["optimizer"], step_cost(adapted, cluster, 8).terms["optimizer"]
    assert 0 < b < a / 100  # rank-16 adapters: a tiny fraction of the whole matrices' Newton-Schulz


def test_offload_prices_the_updates_trip_to_the_device():
    """parallel.offload=cpu: the momentum is on the host and Newton-Schulz on the device, so each
    owned Muon element's fp32 update crosses PCIe up (4 bytes more on that direction than AdamW's
    offload) and the Newton-Schulz FLOPs stay in the (device) optimizer term, which AdamW's offload
    leaves empty."""
    from megaft.perf.muon import block_matrix_elements

    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "cluster", "h100.yaml")))
    fields.pop("defaults")
    cluster = ClusterConfig(**fields)
    cfg = preset_1b(micro=1)
    terms = {}
    for name in ("adamw", "muon"):
        cfg.optim.name = name
        cfg.parallel = dataclasses.replace(cfg.parallel, dp=8, zero=1, offload="cpu")
        terms[name] = step_cost(cfg, cluster, 8).terms
    elements = sum(block_matrix_elements(cfg.model, i) for i in range(cfg.model.n_layers))
    assert terms["muon"]["offload"] - terms["adamw"]["offload"] == pytest.approx(
        4 * elements / 8 / (cluster.pcie_gbps * 1e9), rel=1e-9)
    assert terms["adamw"]["optimizer"] == 0 < terms["muon"]["optimizer"]


def test_copied_kv_heads_gather_every_copy_and_orthogonalise_each_head_once():
    """tp=4 over 2 kv heads: each head sits on 2 ranks, so the k/v all-gather brings 2 copies of each
    head's rows (4 x 16 rows of 64, not 2 x 16), while Newton-Schulz runs on each head once (the
    [32, 64] matrix one process holds); at tp <= the kv heads nothing is copied."""
    from megaft.perf.muon import tp_gathered

    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, max_seq_len=32)
    whole = hidden_matrices(cfg, 0)
    assert tp_gathered(cfg, 0, tp=2) == whole
    got = tp_gathered(cfg, 0, tp=4)
    assert got[1:3] == [(64, 64), (64, 64)] and whole[1:3] == [(32, 64), (32, 64)]
    assert got[:1] + got[3:] == whole[:1] + whole[3:]


def test_under_lora_on_a_mixture_of_experts_the_matrices_are_each_experts_adapters():
    """LoRA on a Qwen2-MoE-shaped block (targets: attention, experts, shared expert, router): the Muon
    matrices are each routed expert's A and B (one per expert of the [E, ...] adapter stacks), the
    shared expert's and the attention's; the router's adapter is on AdamW; what tp gathers are gate/up's
    B and down's A, as megaft.peft.experts splits them; at ep=2 a rank holds half the experts'."""
    from megaft.config.lora import LoraConfig
    from megaft.parallel.tensor.shard import shard_of
    from megaft.peft.lora import apply_lora
    from megaft.perf.muon import tp_gathered

    lora = LoraConfig(rank=4, targets=["q", "v", "o", "experts", "shared_expert", "router"])
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, max_seq_len=32,
                      arch="qwen2_moe", n_experts=4, top_k=2, moe_ffn_dim=32, shared_expert_ffn_dim=48,
                      shared_expert_gate=True)
    model = apply_lora(Decoder(cfg), lora, seed=0, tp_rank=0, tp_size=1)
    split = muon_split(model)
    assert sorted(split["adamw"]) == ["layers.0.mlp.gate.adapter.A", "layers.0.mlp.gate.adapter.B"]

    def matrices(params):  # each expert's matrix of a stack once
        return sorted(tuple(p.shape[-2:]) for p in params for _ in range(p.shape[0] if p.dim() == 3 else 1))

    assert matrices(split["muon"].values()) == sorted(hidden_matrices(cfg, 0, lora=lora))
    assert len(hidden_matrices(cfg, 0, lora=lora)) == 2 * (3 + 3 * 4 + 3)  # attention, 4 experts, shared
    assert matrices(p for p in split["muon"].values() if shard_of(p) is not None) == sorted(
        tp_gathered(cfg, 0, lora=lora))
    assert len(hidden_matrices(cfg, 0, ep=2, lora=lora)) == 2 * (3 + 3 * 2 + 3)
