"""megaft.perf on mixtures of experts (CPU, no ranks): parameter counts equal the built
models' (every family's shape, tp 1 and 2, pipeline ranks, LoRA), FLOPs count the active
weights only, the activation estimate equals the bytes a forward saves, and the memory
estimate and the planner's compute move with top_k and the expert count as the formulas
in megaft.perf.counts say. Under expert parallelism (parallel.ep) a rank's routed experts,
their ZeRO shards (over dp*cp/ep), the dispatch buffers and the all-to-all time, by hand."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from omegaconf import OmegaConf

from megaft.config import Config
from megaft.config.cluster import ClusterConfig
from megaft.config.lora import LoraConfig
from megaft.config.model import ModelConfig
from megaft.layers.linear import ColumnParallelLinear, RowParallelLinear
from megaft.models import saved
from megaft.models.checks import check_model
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.peft.lora import apply_lora
from megaft.perf.counts import (
    a2a_bytes,
    activation_bytes_per_token,
    adapter_layer_params,
    expert_params,
    flops_per_token,
    head_forward_flops,
    layer_forward_flops,
    layer_params,
    matmul_params,
    moe_dispatch_bytes_per_token,
    moe_weight_copy_bytes,
    rank_expert_params,
    rank_params,
    total_params,
)
from megaft.perf.hardware import cluster_hbm_tbps, cluster_peak_tflops
from megaft.perf.memory import estimate_ranks
from megaft.perf.time import _stage_costs, all_to_all_s, step_cost
from megaft.pipeline.stage import StageModel

CONF = os.path.join(os.path.dirname(__file__), os.pardir, "conf")
SHAPE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=61, max_seq_len=64)
FAMILIES = {  # each family's shape, as tests/models/moe_fixture.py builds them from transformers
    "mixtral": dict(arch="mixtral", n_experts=4, top_k=2),  # every block a mixture, experts of ffn_dim
    "qwen2_moe": dict(arch="qwen2_moe", n_experts=4, top_k=2, moe_ffn_dim=32, shared_expert_ffn_dim=48,
                      qkv_bias=True, norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(arch="qwen3_moe", n_experts=4, top_k=2, moe_ffn_dim=32, qk_norm=True, head_dim=24,
                      decoder_sparse_step=2, n_layers=4),  # blocks 1 and 3 are mixtures
    "olmoe": dict(arch="olmoe", n_experts=4, top_k=2, ffn_dim=32, qk_norm=True, qk_norm_width="full",
                  norm_topk_prob=False, tie_embeddings=True),
    # latent attention (with a query latent), ungated shared experts, a dense first block
    "deepseek_v3": dict(arch="deepseek_v3", n_experts=8, top_k=2, moe_ffn_dim=32, shared_expert_ffn_dim=64,
                        shared_expert_gate=False, mlp_only_layers=[0], router_scoring="sigmoid", n_group=4,
                        router_aux_loss_coef=0.0,
                        topk_group=2, routed_scaling_factor=2.5, n_kv_heads=4, head_dim=8, kv_lora_rank=16,
                        q_lora_rank=24, qk_nope_head_dim=16, v_head_dim=12, rope_interleave=True),
}


def moe(family: str, **kw) -> ModelConfig:
    return ModelConfig(**{**SHAPE, **FAMILIES[family], **kw})


@pytest.fixture
def tp_group(monkeypatch):
    """A stand-in tp group of `tp` ranks (this process is rank 0) for building one tp shard of a
    model without processes: construction only asks the group its size and rank."""
    def make(tp: int):
        if tp == 1:
            return None
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: tp)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
        return object()
    return make


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- parameters ----------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_param_counts_equal_the_built_model(family, tp, tp_group):
    cfg = moe(family)
    assert check_model(cfg, tp) == []
    group = tp_group(tp)
    model = Decoder(cfg, group=group)
    kinds = [cfg.is_moe(i) for i in range(cfg.n_layers)]
    assert kinds == {"mixtral": [True] * 3, "qwen2_moe": [True, False, True], "qwen3_moe": [False, True] * 2,
                     "olmoe": [True] * 3, "deepseek_v3": [False, True, True]}[family]
    for i, block in enumerate(model.layers):  # per block: dense or MoE, norms, biases, tp slices
        assert layer_params(cfg, tp, i) == numel(block), (family, tp, i)
    assert rank_params(cfg, tp=tp, pp=1, vpp=1) == [numel(model)]
    if tp == 1:
        assert total_params(cfg) == numel(model)
    # pipeline ranks (interleaved where the depth allows), the tied head copied onto the last
    pp, vpp = (2, 2) if cfg.n_layers == 4 else (2, 1)
    stages = [numel(StageModel(cfg, pp=pp, pp_rank=r, vpp=vpp, group=group)) for r in range(pp)]
    assert rank_params(cfg, tp=tp, pp=pp, vpp=vpp) == stages


def test_param_counts_hold_every_expert():
    """By hand: a Mixtral-like block holds E experts of 3 * dim * F, the router E * dim; a
    Qwen2-MoE-like one adds the shared expert (3 * dim * S) and its gate (dim)."""
    cfg, d = moe("mixtral"), SHAPE["dim"]
    attn, norms = 2 * d * 64 + 2 * d * 32, 2 * d  # q, o: 4 heads of 16; k, v: 2 kv heads
    assert layer_params(cfg, 1, 0) == attn + norms + 4 * d + 4 * 3 * d * 96
    assert layer_params(cfg, 2, 0) == attn // 2 + norms + 4 * d + 4 * 3 * d * 96 // 2  # the router is whole
    q2 = moe("qwen2_moe")
    biases = 64 + 2 * 32  # q/k/v (Qwen2's qkv_bias)
    assert layer_params(q2, 1, 0) == attn + biases + norms + 4 * d + 4 * 3 * d * 32 + 3 * d * 48 + d
    assert layer_params(q2, 1, 1) == attn + biases + norms + 3 * d * 96  # mlp_only_layers: dense
    assert layer_params(q2, 1) == layer_params(q2, 1, 0)  # None: the largest block
    ol = moe("olmoe")  # full-width qk norms: [heads * hd] and [kv_heads * hd], split over tp
    assert layer_params(ol, 2, 0) - layer_params(moe("olmoe", qk_norm=False), 2, 0) == (64 + 32) // 2


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("targets", [None, ["q", "gate", "experts", "shared_expert", "router"]])
def test_lora_counts_equal_the_adapters_built(family, tp, tp_group, targets):
    """Adapters on attention and the dense MLPs by default; with `experts`, `shared_expert` and
    `router` (megaft.peft.experts) also per-expert pairs, the shared expert's and the router's."""
    cfg = moe(family)
    lora = LoraConfig(rank=4) if targets is None else LoraConfig(rank=4, targets=targets)
    if "shared_expert" in lora.targets and not cfg.shared_expert_ffn_dim:
        lora.targets.remove("shared_expert")
    group = tp_group(tp)
    model = apply_lora(Decoder(cfg, group=group), lora, seed=0, tp_rank=0, tp_size=tp, group=group)
    found = {}
    for name, p in model.named_parameters():
        if ".adapter." in name:
            i = int(name.split(".")[1])
            found[i] = found.get(i, 0) + p.numel()
    for i in range(cfg.n_layers):
        assert adapter_layer_params(cfg, lora, tp, i)[0] == found.get(i, 0), (family, tp, i)
    if family == "mixtral" and targets is None:  # no shared expert: attention's four adapters only
        assert adapter_layer_params(cfg, lora, 1, 0)[0] == 4 * (4 * 64 + 4 * 64) - 2 * 4 * 32


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("q_latent", [True, False])
def test_lora_counts_on_latent_attention_equal_the_adapters_built(tp, tp_group, q_latent):
    """DeepSeek-V3's MLA: o_proj adapts, q_proj too without a query latent (validation refuses
    the targets that adapt nothing); the base linears are the tp-split ones (q_b or q_proj, kv_b,
    o and the MLPs), the latent down projections stay as they are."""
    cfg = moe("deepseek_v3", **({} if q_latent else {"q_lora_rank": None}))
    targets = ["o", "gate", "up", "down", "experts", "shared_expert", "router"] + ([] if q_latent else ["q"])
    lora = LoraConfig(rank=4, targets=targets)
    group = tp_group(tp)
    model = apply_lora(Decoder(cfg, group=group), lora, seed=0, tp_rank=0, tp_size=tp, group=group)
    for i, block in enumerate(model.layers):
        adapters = sum(p.numel() for name, p in block.named_parameters() if ".adapter." in name)
        base = sum(mod.weight.numel() for mod in block.modules()
                   if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)))
        assert adapter_layer_params(cfg, lora, tp, i) == (adapters, base), (tp, q_latent, i)
    assert any(name.endswith("q_proj.adapter.A") for name, _ in model.named_parameters()) == (not q_latent)


# --- FLOPs ---------------------------------------------------------------------------------

def test_flops_count_the_active_experts_only():
    d, f, e, layers, seq = 64, 96, 4, 3, 32
    dense = ModelConfig(**{**SHAPE, "ffn_dim": f})
    top1 = moe("mixtral", top_k=1)
    # one expert of F per token, as a dense MLP of F, plus the router's 6 * E * dim per block
    assert flops_per_token(top1, seq) == flops_per_token(dense, seq) + 6 * e * d * layers
    # each further expert a token visits adds 6 * 3 * dim * F per block; idle experts add their router rows only
    assert flops_per_token(moe("mixtral"), seq) == flops_per_token(top1, seq) + 6 * 3 * d * f * layers
    more = flops_per_token(moe("mixtral", n_experts=8), seq)
    assert more == flops_per_token(moe("mixtral"), seq) + 6 * 4 * d * layers
    # Qwen2-MoE-like: two MoE blocks (router, 2 experts of 32, shared expert of 48 and its gate), one dense
    q2 = moe("qwen2_moe")
    attention = 2 * d * 64 + 2 * d * 32
    active = 3 * attention + 2 * (e * d + 2 * 3 * d * 32 + 3 * d * 48 + d) + 3 * d * 96 + d * 61
    assert matmul_params(q2) == active
    assert flops_per_token(q2, seq) == 6 * active + 12 * layers * 4 * 16 * seq
    assert total_params(q2) > matmul_params(q2) + 2 * 2 * 3 * d * 32  # every expert is held
    # the per-block forward FLOPs add up to the model's (a third of the training FLOPs)
    for cfg in (moe(name) for name in FAMILIES):
        blocks = sum(layer_forward_flops(cfg, seq, i) for i in range(cfg.n_layers))
        assert 3 * (blocks + head_forward_flops(cfg)) == pytest.approx(flops_per_token(cfg, seq), rel=1e-12)
        assert cfg.n_layers * layer_forward_flops(cfg, seq) == pytest.approx(blocks, rel=1e-12)


def cluster() -> ClusterConfig:
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "cluster", "h100.yaml")))
    fields.pop("defaults")
    return ClusterConfig(**fields)


def run_config(model: ModelConfig, *, precision: str = "fp32", seq: int = 32, micro: int = 2, **parallel) -> Config:
    cfg = Config()
    cfg.model = model
    cfg.data.seq_len, cfg.precision, cfg.device = seq, precision, "cpu"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = micro, micro * parallel.pop("dp", 1)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def test_planner_compute_follows_the_active_flops():
    """megaft-plan prices a block by the FLOPs its tokens multiply: the compute term of a
    top-1 mixture is the dense model's scaled by the FLOPs ratio, and its MFU reads the same count."""
    # at one rate for every FLOP (no GEMM curve, gemm_sms=0): under the curve a tiny model's GEMMs
    # are priced by their shapes (megaft.perf.gemm, tests/test_perf_gemm.py), not their FLOPs alone; no
    # elementwise kernels (hbm_fraction=0): they are priced by bytes (tests/test_perf_kernels.py)
    seq, h100 = 32, dataclasses.replace(cluster(), gemm_sms=0, hbm_fraction=0.0)
    dense = step_cost(run_config(ModelConfig(**SHAPE), seq=seq), h100, 1)
    top1 = step_cost(run_config(moe("mixtral", top_k=1), seq=seq), h100, 1)
    assert top1.flops_per_token == flops_per_token(moe("mixtral", top_k=1), seq)
    ratio = top1.flops_per_token / dense.flops_per_token
    assert top1.terms["compute"] == pytest.approx(dense.terms["compute"] * ratio, rel=1e-12)
    # the compute term is the training FLOPs of the step's tokens at the achievable rate, summed per block
    rate = cluster_peak_tflops(h100, "fp32") * 1e12 * h100.matmul_fraction
    for name in FAMILIES:
        cost = step_cost(run_config(moe(name), seq=seq), h100, 1)
        assert cost.terms["compute"] == pytest.approx(2 * seq * flops_per_token(moe(name), seq) / rate, rel=1e-12)
    # Qwen2-MoE-like over pp=3: the dense block's stage computes less than the MoE blocks' stages,
    # and ZeRO moves each stage's own parameters (all experts)
    cfg = run_config(moe("qwen2_moe"), seq=seq, pp=3)
    assert step_cost(cfg, h100, 3).flops_per_token == flops_per_token(cfg.model, seq)
    stages = _stage_costs(cfg, h100, 1)
    assert stages[1]["f_compute"] < stages[0]["f_compute"] < stages[2]["f_compute"]  # the head is on the last
    zero2 = _stage_costs(run_config(moe("qwen2_moe"), seq=seq, pp=3, zero=2, dp=2), h100, 2)
    assert zero2[1]["b_zero"] < zero2[0]["b_zero"]
    for zero in (2, 3):  # ZeRO-3's per-block gathers and ZeRO-2's reduce-scatters price every expert
        small = step_cost(run_config(moe("mixtral"), seq=seq, zero=zero, dp=8), h100, 8)
        big = step_cost(run_config(moe("mixtral", n_experts=8), seq=seq, zero=zero, dp=8), h100, 8)
        assert big.terms["zero_comm"] > small.terms["zero_comm"]
        assert big.terms["compute"] == pytest.approx(
            small.terms["compute"] * big.flops_per_token / small.flops_per_token, rel=1e-12)


# --- activation bytes: the formula, against what the forward saves ---------------------------

def mixtral_tiny(layers: int = 2, **kw) -> ModelConfig:
    return ModelConfig(**{**SHAPE, "arch": "mixtral", "n_layers": layers, "ffn_dim": 128, "vocab_size": 50,
                          "max_seq_len": 256, "n_experts": 4, "top_k": 2, **kw})


def block_saved_bytes(kw: dict, precision: str) -> float:
    """One block's saved bytes per token (megaft.models.saved.block_bytes), bf16 under CPU autocast."""
    def measure(layers: int, seq: int) -> int:
        cfg = mixtral_tiny(layers, **kw)
        model = Decoder(cfg)
        init_params(model, cfg, seed=1, tp_rank=0, tp_size=1)
        ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return saved.saved_bytes(model, lambda: model.loss_sum(ids, ids))
    return saved.block_bytes(measure, 32) / 64


QWEN2_LIKE = dict(arch="qwen2_moe", shared_expert_ffn_dim=96, moe_ffn_dim=32, norm_topk_prob=False)


def test_moe_activation_bytes_by_hand():
    """The documented formula (counts.moe_activation_bytes_per_token) worked by hand for a
    Mixtral-like block: dim 64, F 128, E 4, top 2, fp32, tp 1."""
    d, f, e, k = 64, 128, 4, 2
    norms = 2 * (2 * d + 1) * 4 + d * 4  # both norms' fp32 input, normalized rows and rstd; q/k/v's input
    attention = (2 * 4 * 16 + 2 * 2 * 16) * 4 + 4 * 4  # q, k, v, out; fp32 log-sum-exp per head
    router = d * 4 + (2 * e + 1) * 4 + k * 8 + (k + 1) * 4 + k * 4  # input, logits/probs/lse, top-k, weights
    dispatch = 2 * k * 8
    routed = k * d * 4 + 4 * k * f * 4 + k * d * (4 + 4)  # sorted input, gate/up/act/product, down + copy
    block = norms + attention + router + dispatch + routed
    assert block == 8064
    cfg = mixtral_tiny()
    assert activation_bytes_per_token(cfg, tp=1, sequence_parallel=False, precision="fp32") == block
    # selective: no log-sum-exp, one F-wide tensor less per routed copy; full: the block's input
    assert activation_bytes_per_token(cfg, tp=1, sequence_parallel=False, precision="fp32",
                                      recompute="selective") == block - 4 * 4 - k * f * 4
    assert activation_bytes_per_token(cfg, tp=1, sequence_parallel=False, precision="fp32", recompute="full") == d * 4
    # tp 2, sequence parallel, bf16: the routed copies are whole-token, their F split; the router's are sharded
    bf = activation_bytes_per_token(cfg, tp=2, sequence_parallel=True, precision="bf16", layer=0)
    want = (2 * (2 * d + 1) * 4 / 2 + d * 2 + (2 * 4 * 16 + 2 * 2 * 16) * 2 / 2 + 4 * 4 / 2
            + (d * 4 + (2 * e + 1) * 4 + k * 8 + (k + 1) * 4) / 2 + k * 4 + dispatch
            + k * d * 2 + 4 * k * f * 2 / 2 + k * d * (2 + 2))  # down output + its token-order copy
    assert bf == want


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("kw", [{}, QWEN2_LIKE], ids=["mixtral", "qwen2_moe"])
def test_moe_activation_bytes_equal_the_saved_bytes(kw, recompute):
    """fp32: the estimate is the bytes one MoE block saves, exactly (router, dispatch, routed
    copies, the shared expert and its gate)."""
    kw = {**kw, "recompute": recompute}
    measured = block_saved_bytes(kw, "fp32")
    assert measured == activation_bytes_per_token(mixtral_tiny(**kw), tp=1, sequence_parallel=False,
                                                  precision="fp32", recompute=recompute)


def test_moe_activation_bytes_under_bf16():
    """bf16 (CPU autocast): what top_k and the expert count add per token is exactly the
    estimate's (the attention part, which the CPU path saves a little differently from the
    GPU kernels the dense formula follows, cancels); the compute-dtype copies of the expert
    weights the grouped GEMMs keep are moe_weight_copy_bytes per block and micro-batch."""
    def est(**kw):
        return activation_bytes_per_token(mixtral_tiny(**kw), tp=1, sequence_parallel=False, precision="bf16")

    assert block_saved_bytes({}, "bf16") - block_saved_bytes({"top_k": 1}, "bf16") == est() - est(top_k=1)
    assert block_saved_bytes({"n_experts": 8}, "bf16") - block_saved_bytes({}, "bf16") == est(n_experts=8) - est()

    def total(layers: int) -> int:
        cfg = mixtral_tiny(layers)
        model = Decoder(cfg)
        init_params(model, cfg, seed=1, tp_rank=0, tp_size=1)
        ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return saved.saved_bytes(model, lambda: model.loss_sum(ids, ids))

    weight_sized = total(2) - total(1) - 64 * block_saved_bytes({}, "bf16")
    attention_copies = (2 * 64 * 64 + 2 * 32 * 64) * 2  # autocast's q/k/v/o copies (not in the estimate)
    copies = moe_weight_copy_bytes(mixtral_tiny(), tp=1, layer=0, copies=True)
    assert copies == 3 * 4 * 64 * 128 * 2 and weight_sized - attention_copies == copies


# --- the memory estimate -------------------------------------------------------------------

def test_memory_estimate_by_hand():
    """fp32, one rank: params/grads/moments of every expert; activations = tokens x the blocks'
    bytes + the head's logits; a dense block of a mixed model counts as dense."""
    cfg = run_config(mixtral_tiny(3, arch="qwen2_moe", mlp_only_layers=[1], shared_expert_ffn_dim=48))
    m, tokens = cfg.model, 2 * 32
    est = estimate_ranks(cfg, 1)[0]
    n = total_params(m)
    assert (est.params, est.grads, est.optimizer) == (4 * n, 4 * n, 8 * n)
    blocks = [activation_bytes_per_token(m, tp=1, sequence_parallel=False, precision="fp32", layer=i) for i in range(3)]
    dense = activation_bytes_per_token(mixtral_tiny(3, n_experts=0, arch="llama"), tp=1, sequence_parallel=False,
                                       precision="fp32")
    assert blocks[1] == dense and blocks[0] == blocks[2] != dense
    assert est.activations == tokens * sum(blocks) + 2 * tokens * 50 * 4


def test_memory_estimate_grows_with_top_k_and_experts():
    d, f, tokens, layers = 64, 128, 2 * 32, 2

    def est(precision="fp32", master=False, **kw):
        cfg = run_config(mixtral_tiny(layers, **kw), precision=precision)
        cfg.optim.master_weights = master
        return estimate_ranks(cfg, 1)[0]

    # fp32: one more expert per token adds, per MoE block and token, the sorted input d*4, gate/up/act/product
    # 4*F*4, the down output and its copy d*8, an index 8, a weight 4 and a top-k value 4, two dispatch indices 16
    per_k = d * 4 + 4 * f * 4 + d * 8 + 8 + 4 + 4 + 16
    assert est().activations - est(top_k=1).activations == layers * tokens * per_k
    assert est().params == est(top_k=1).params  # top_k changes no weight
    # more experts: their weights (params, grads, moments) and the router's logits and probabilities
    per_expert = 3 * d * f + d
    more = est(n_experts=8)
    assert more.params - est().params == layers * 4 * per_expert * 4
    assert more.optimizer - est().optimizer == layers * 4 * per_expert * 8
    assert more.activations - est().activations == layers * tokens * 4 * 2 * 4
    # bf16 over fp32 weights: each block also keeps bf16 copies of its experts for backward
    bf, bf8 = est("bf16"), est("bf16", n_experts=8)
    assert bf8.activations - bf.activations == layers * (tokens * 4 * 2 * 4 + 4 * 3 * d * f * 2)
    assert bf.activations - est("bf16", master=True).activations == layers * 4 * 3 * d * f * 2
    # full recompute keeps the blocks' inputs and, for the one being recomputed, everything
    full = run_config(mixtral_tiny(layers, recompute="full"), precision="bf16")
    every = activation_bytes_per_token(full.model, tp=1, sequence_parallel=False, precision="bf16", layer=0)
    assert estimate_ranks(full, 1)[0].activations == (layers * tokens * d * 4 + tokens * every + 4 * 3 * d * f * 2
                                                      + 2 * tokens * 50 * 4)


# --- expert parallelism (parallel.ep) --------------------------------------------------------
#
# mixtral_tiny(2) by hand: per block attention q/o 64x64, k/v 64x32 (12288), two norms (128) and
# the router 4 x 64 (256), the dense part every rank holds; 4 experts of 3 x 64 x 128 (24576 each).
# Embedding and untied head 50 x 64 each, the final norm 64.
BLOCK_DENSE, EXPERT = 12288 + 128 + 256, 3 * 64 * 128
TINY_DENSE = 2 * BLOCK_DENSE + 2 * 50 * 64 + 64  # 31808: replicated over dp x cp whatever ep
TINY_EXPERTS = 2 * 4 * EXPERT  # 196608: the routed experts of both blocks, split over ep


def test_rank_params_divide_the_routed_experts_by_ep():
    m = mixtral_tiny(2)
    assert rank_params(m, tp=1, pp=1, vpp=1) == [TINY_DENSE + TINY_EXPERTS] == [228416]
    for ep in (2, 4):
        assert rank_params(m, tp=1, pp=1, vpp=1, ep=ep) == [TINY_DENSE + TINY_EXPERTS // ep]
        assert rank_expert_params(m, tp=1, pp=1, vpp=1, ep=ep) == [TINY_EXPERTS // ep]
        assert expert_params(m, 0, 1, ep) == 4 // ep * EXPERT
        assert layer_params(m, 1, 0, ep) == BLOCK_DENSE + 4 // ep * EXPERT
    # tp splits each expert's F as before; pp: each rank its block's experts / ep, the ends their vocab
    assert rank_params(m, tp=2, pp=1, vpp=1, ep=2) == [rank_params(m, tp=2, pp=1, vpp=1)[0] - TINY_EXPERTS // 4]
    assert rank_params(m, tp=1, pp=2, vpp=1, ep=2) == [BLOCK_DENSE + 3200 + 2 * EXPERT,
                                                       BLOCK_DENSE + 3200 + 64 + 2 * EXPERT]
    # Qwen2-MoE-like: the shared expert (48) and its gate stay whole, the dense block too; only the routed halve
    q2 = moe("qwen2_moe")
    routed = 2 * 4 * 3 * 64 * 32  # two MoE blocks of 4 experts of F 32
    assert rank_params(q2, tp=1, pp=1, vpp=1, ep=2) == [total_params(q2) - routed // 2]
    assert [expert_params(q2, i, 1, 2) for i in range(3)] == [2 * 3 * 64 * 32, 0, 2 * 3 * 64 * 32]
    # the whole-model counts do not change: FLOPs count the active experts, wherever they live
    assert total_params(q2) == rank_params(q2, tp=1, pp=1, vpp=1)[0]


def test_memory_at_ep2_halves_the_expert_part_only():
    """fp32, dp=2, ZeRO 0: params/grads/moments of the dense part as at ep=1, of the experts
    half; activations gain the dispatch buffers (send + receive, top_k rows of dim per token)."""
    tokens, k, d = 2 * 32, 2, 64
    one = estimate_ranks(run_config(mixtral_tiny(2), dp=2), 2)[0]
    two = estimate_ranks(run_config(mixtral_tiny(2), dp=2, ep=2), 2)[0]
    assert (one.params, one.grads, one.optimizer) == (4 * 228416, 4 * 228416, 8 * 228416)
    assert two.params == two.grads == 4 * (TINY_DENSE + TINY_EXPERTS // 2) == 4 * 130112
    assert two.optimizer == 8 * (TINY_DENSE + TINY_EXPERTS // 2)
    assert one.params - two.params == 4 * TINY_EXPERTS // 2  # the expert part halves, nothing else moves
    assert two.activations - one.activations == 2 * tokens * (2 * k * d * 4)  # two MoE blocks' buffers, fp32
    assert two.buffers == one.buffers == 0


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_at_ep2_shards_the_experts_over_their_own_replicas(zero):
    """dp=4, ep=2: the dense part shards over the 4 replicas, each rank's half of the experts
    over the 2 ranks holding the same experts (dp*cp/ep); ZeRO-3 gathers blocks of 2 experts."""
    cfg = run_config(mixtral_tiny(2), dp=4, ep=2, zero=zero)
    est = estimate_ranks(cfg, 4)[0]
    mine = TINY_EXPERTS // 2  # this rank's 2 experts of each block

    def sharded(nbytes: int, stage: int) -> int:
        return (TINY_DENSE * nbytes // 4 + mine * nbytes // 2) if zero >= stage else (TINY_DENSE + mine) * nbytes

    assert est.optimizer == sharded(8, 1)
    assert est.grads == sharded(4, 2)
    assert est.params == sharded(4, 3)
    bucket = int(2 * cfg.parallel.bucket_mb * 2 ** 20)  # ZeRO-2/3's reduce-scatter scratch
    gathered = 2 * 2 * (BLOCK_DENSE + 2 * EXPERT) * 4  # ZeRO-3: the running and the next block, params and grads
    assert est.buffers == (0 if zero < 2 else bucket) + (gathered if zero == 3 else 0)
    # against ep=1 (all 4 experts, every part over the 4 replicas): the dense part is the same
    base = estimate_ranks(run_config(mixtral_tiny(2), dp=4, zero=zero), 4)[0]
    if zero == 3:
        assert base.params == 228416 * 4 // 4 and est.params == TINY_DENSE + 2 * mine
    assert base.optimizer == 228416 * 8 // 4 and est.optimizer == 2 * TINY_DENSE + 4 * mine


def test_dispatch_buffers_per_moe_block_in_flight():
    """The all-to-all's send and receive buffers: 2 x tokens x top_k x dim in the compute
    dtype per MoE block, for every micro-batch in flight, only at ep > 1; the bf16 copies of
    the expert weights the grouped GEMMs keep hold the rank's n_experts/ep experts."""
    d, k, f, tokens = 64, 2, 128, 2 * 32
    m = mixtral_tiny(2)
    assert moe_dispatch_bytes_per_token(m, half=2, ep=2) == 2 * k * d * 2
    assert moe_dispatch_bytes_per_token(m, half=2, ep=1) == 0
    assert moe_weight_copy_bytes(m, tp=1, layer=0, copies=True, ep=2) == 3 * 2 * d * f * 2
    per_token = dict(tp=1, sequence_parallel=False, precision="bf16")
    assert (activation_bytes_per_token(m, ep=4, **per_token) - activation_bytes_per_token(m, **per_token)
            == 2 * k * d * 2)
    q2 = mixtral_tiny(3, **QWEN2_LIKE, mlp_only_layers=[1])  # a dense block gets no buffers
    assert (activation_bytes_per_token(q2, layer=1, ep=2, **per_token)
            == activation_bytes_per_token(q2, layer=1, **per_token))

    def acts(ep: int, **kw) -> list[int]:
        cfg = run_config(mixtral_tiny(2, **kw), precision="bf16", dp=2, ep=ep)
        return [e.activations for e in estimate_ranks(cfg, 2 * cfg.parallel.pp)]

    buffers, copies = tokens * 2 * k * d * 2, 3 * 2 * d * f * 2  # per block: the buffers, the halved copies
    assert acts(2)[0] - acts(1)[0] == 2 * (buffers - copies)
    # full recompute: blocks keep their input only; the one being recomputed holds its buffers again
    assert acts(2, recompute="full")[0] - acts(1, recompute="full")[0] == buffers - copies
    # pp=2, 1f1b with 4 micro-batches: rank 0 holds 2 in flight, rank 1 one, of its one MoE block
    cfg = run_config(mixtral_tiny(2), precision="bf16", dp=2, ep=2, pp=2)
    cfg.train.global_batch_size = 4 * 2 * 2
    base = run_config(mixtral_tiny(2), precision="bf16", dp=2, pp=2)
    base.train.global_batch_size = 4 * 2 * 2
    diff = [a.activations - b.activations for a, b in zip(estimate_ranks(cfg, 4), estimate_ranks(base, 4))]
    assert diff == [2 * (buffers - copies), buffers - copies]


def test_ep1_figures_are_unchanged():
    """ep=1 is the layout without expert parallelism: no buffers, every expert on every rank,
    no ep_comm."""
    m = mixtral_tiny(2)
    assert rank_params(m, tp=2, pp=1, vpp=1, ep=1) == rank_params(m, tp=2, pp=1, vpp=1)
    assert rank_expert_params(m, tp=1, pp=1, vpp=1) == [TINY_EXPERTS]
    cost = step_cost(run_config(m, dp=4, zero=1), cluster(), 4)
    assert cost.terms["ep_comm"] == 0.0


def test_time_model_prices_the_all_to_alls():
    """ep_comm: per MoE block and pass (forward, backward; the recomputed forward again under
    full) the dispatch and combine of the rank's tokens' top_k rows, counts.a2a_bytes at
    NVLink's rate inside a node; the experts' ZeRO traffic and Adam state over dp*cp/ep."""
    from benchmarks.moe import a2a_formula_bytes

    assert a2a_formula_bytes is a2a_bytes  # the benchmark checks the count the model prices
    h100, tokens, k, d, seq = dataclasses.replace(cluster(), gemm_sms=0), 2 * 32, 2, 64, 32  # one rate: FLOPs
    link = h100.nvlink_gbps * 1e9 * h100.comm_fraction
    lat = h100.nvlink_latency_us * 1e-6
    for ep, precision, act in ((2, "bf16", 2), (4, "fp32", 4)):
        cfg = run_config(mixtral_tiny(2), dp=4, ep=ep, zero=1, precision=precision, seq=seq)
        one_pass = a2a_bytes(tokens, k, d, act, ep) / link + 2 * (ep - 1) * lat
        assert a2a_bytes(tokens, k, d, act, ep) == 2 * tokens * k * (ep - 1) / ep * d * act
        cost = step_cost(cfg, h100, 4)
        assert cost.terms["ep_comm"] == pytest.approx(2 * 2 * one_pass, rel=1e-12)  # 2 MoE blocks x (f + b)
        base = step_cost(run_config(mixtral_tiny(2), dp=4, zero=1, precision=precision, seq=seq), h100, 4)
        assert cost.terms["compute"] == base.terms["compute"]  # every rank computes top_k rows per token still
        # the Adam state of the rank's experts is sharded over dp*cp/ep ranks instead of dp*cp
        owned = TINY_DENSE / 4 + TINY_EXPERTS / ep / (4 // ep)
        assert cost.terms["optimizer"] == pytest.approx(owned * 32 / (cluster_hbm_tbps(h100) * 1e12), rel=1e-12)
        # ZeRO-1's all-gather of the updated params: the dense part over the 4 replicas, then the rank's
        # experts over the 4/ep holding the same ones (none to gather at ep=4), ring formulas over NVLink
        experts = 4 // ep
        gather = (3 / 4 * TINY_DENSE * 4 / link + 3 * lat
                  + ((experts - 1) / experts * TINY_EXPERTS / ep * 4 / link + (experts - 1) * lat))
        assert cost.terms["param_gather"] == pytest.approx(gather, rel=1e-12)
        assert base.terms["param_gather"] == pytest.approx(3 / 4 * 228416 * 4 / link + 3 * lat, rel=1e-12)
        full = run_config(mixtral_tiny(2, recompute="full"), dp=4, ep=ep, zero=1, precision=precision, seq=seq)
        assert step_cost(full, h100, 4).terms["ep_comm"] == pytest.approx(3 / 2 * cost.terms["ep_comm"], rel=1e-12)
    # across nodes: an ep group of 4 ranks tp=4 apart spans two 8-GPU nodes; each rank's rows to the other
    # node (2 of its 3 peers) leave by its NIC, the rest cross NVLink at the same time
    ib = h100.ib_gbps * 1e9 * h100.comm_fraction
    assert all_to_all_s(3e6, 4, h100, 4) == pytest.approx(max(2e6 / ib, 1e6 / link) + 3 * h100.ib_latency_us * 1e-6)
    assert all_to_all_s(3e6, 1, h100) == 0.0
