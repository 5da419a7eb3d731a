"""optim.name=muon (issue 41): the split (hidden 2-D weights on Muon, the rest on AdamW), every
weight after N steps bitwise equal to torch.optim.Muon + torch.optim.AdamW(foreach=False) on a
copy of the model (fp32; optim.fused=torch runs AdamW's torch ops in torch's order, Muon's ops
are torch.optim.Muon's: exact), dp=2 at ZeRO 0-3, tp=2, pp=2 and cp=2 equal to one process, resume bit
for bit (the momentum in the checkpoint), summary.json's split, and the layouts not done yet
refused in validation; LoRA adapters on Muon equal torch.optim.Muon and, at tp=2 and dp=2 ZeRO-1, one process;
master weights (bf16 params, fp32 masters and momentum): the masters equal torch.optim.Muon on fp32 copies fed the
same bf16 grads, dp=2 ZeRO-1 and tp=2 equal one process within a derived bound, resume bit for bit."""
import copy
import dataclasses
import json
import os

import pytest
import torch
from multirank import spawn
from train_cases import layout_grid, read_metrics, small_config

from megaft.checkpoint import io
from megaft.config import Config
from megaft.config.lora import LoraConfig
from megaft.config.model import ModelConfig
from megaft.config.optim import OptimConfig
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.optim.muon import MuonAdamW, flat_split, muon_split, update_scale
from megaft.optim.schedule import lr_at
from megaft.parallel.comm import all_gather
from megaft.parallel.data import FlatParams
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.shard import expert_slice_of, shard_of
from megaft.training.loop import Trainer
from megaft.training.summary import RunSummary
from megaft.validation import resolve, validate

STEPS = 4
LRS = [0.02, 0.015, 0.01, 0.005]  # a changing lr: each step's lr reaches both optimizers
VARIANTS = {  # optim.muon overrides
    "default": {},
    "moonlight": dict(scale="match_rms_adamw", weight_decay=0.05),
    "plain_momentum": dict(nesterov=False, momentum=0.9, ns_steps=3),
}


def tiny_model() -> Decoder:
    """Qwen2's q/k/v biases (1-D: AdamW) beside the projections; untied embedding and head."""
    cfg = ModelConfig(qkv_bias=True, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=40,
                      max_seq_len=16)
    model = Decoder(cfg)
    init_params(model, cfg, seed=3, tp_rank=0, tp_size=1)
    return model


def tiny_moe() -> Decoder:
    """Mixtral-shaped: 4 routed experts of top-2 in each block (3-D stacks), the router on AdamW."""
    cfg = ModelConfig(arch="mixtral", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, moe_ffn_dim=24,
                      n_experts=4, top_k=2, vocab_size=40, max_seq_len=16)
    model = Decoder(cfg)
    init_params(model, cfg, seed=3, tp_rank=0, tp_size=1)
    return model


def batches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 40, (2, 12), generator=gen) for _ in range(STEPS)]


def run_megaft(model, optim: OptimConfig) -> dict[str, torch.Tensor]:
    split = muon_split(model)
    flat = FlatParams(model, weight_decay=optim.weight_decay, device=torch.device("cpu"), **flat_split(split))
    opt = MuonAdamW(flat, optim, split=split)
    assert not any(v.numel() for g, v in zip(flat.groups, opt.exp_avg_sq) if g.momentum_only)  # one buffer
    for ids, lr in zip(batches(), LRS):
        model.loss_sum(ids, ids).backward()
        opt.step(lr)
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_torch(model, optim: OptimConfig, feed=None) -> dict[str, torch.Tensor]:
    """The same model's hidden matrices on torch.optim.Muon, the rest on torch.optim.AdamW with
    megaft's decay classes (matrices decayed, vectors not). `feed`: each step's {name: grad}, given
    in place of the model's backward."""
    split, mu = muon_split(model), optim.muon
    # torch.optim.Muon takes 2-D parameters: each routed expert's matrix is one, copied in and out
    stacks = {n: p for n, p in split["muon"].items() if p.dim() == 3}
    experts = {n: [torch.nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])] for n, p in stacks.items()}
    matrices = [p for n, p in split["muon"].items() if n not in stacks] + [q for qs in experts.values() for q in qs]
    muon = torch.optim.Muon(matrices, lr=LRS[0], momentum=mu.momentum, nesterov=mu.nesterov,
                            weight_decay=optim.weight_decay if mu.weight_decay is None else mu.weight_decay,
                            ns_coefficients=(mu.ns_a, mu.ns_b, mu.ns_c), eps=mu.eps, ns_steps=mu.ns_steps,
                            adjust_lr_fn=str(mu.scale))
    rest = list(split["adamw"].values())
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=LRS[0], betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=False)
    for step, (ids, lr) in enumerate(zip(batches(), LRS)):
        if feed is None:
            model.loss_sum(ids, ids).backward()
        for n, p in model.named_parameters() if feed is not None else ():
            p.grad = feed[step][n].clone()
        for n, qs in experts.items():
            for e, q in enumerate(qs):
                q.grad = stacks[n].grad[e].clone()
        for opt in (muon, adamw):
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=False)
        with torch.no_grad():
            for n, qs in experts.items():
                stacks[n].copy_(torch.stack([q.detach() for q in qs]))
                stacks[n].grad.zero_()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_split_names_the_hidden_matrices():
    split = muon_split(tiny_model())
    assert sorted(split["adamw"]) == sorted(
        ["embed_tokens.weight", "lm_head.weight", "norm.weight"]
        + [f"layers.{i}.{n}" for i in range(2) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                                          "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                          "self_attn.v_proj.bias")])
    assert sorted(split["muon"]) == sorted(f"layers.{i}.{m}.{n}_proj.weight" for i in range(2)
                                           for m, ns in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
                                           for n in ns)


def test_expert_stacks_take_muon_and_the_router_adamw():
    split = muon_split(tiny_moe())
    assert sorted(n for n, p in split["muon"].items() if p.dim() == 3) == sorted(
        f"layers.{i}.mlp.experts.{n}_proj" for i in range(2) for n in ("gate", "up", "down"))
    assert {f"layers.{i}.mlp.gate.weight" for i in range(2)} <= set(split["adamw"])


def test_a_stack_is_orthogonalised_expert_by_expert():
    """The batched Newton-Schulz of a [E, rows, cols] stack against a loop over its experts (wide and
    tall matrices; the same bf16 ops per matrix: equal up to bf16 rounding, measured equal here)."""
    from megaft.optim.muon import zeropower_via_newtonschulz as ns

    for shape in ((4, 24, 40), (3, 40, 24)):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        got = ns(g, 3.4445, -4.7750, 2.0315, 5, 1e-7).float()
        want = torch.stack([ns(g[e], 3.4445, -4.7750, 2.0315, 5, 1e-7) for e in range(shape[0])]).float()
        assert (got - want).abs().max() <= 1e-2, shape
        whole = ns(g.reshape(-1, shape[-1]), 3.4445, -4.7750, 2.0315, 5, 1e-7).float().view(shape)
        assert (whole - want).abs().max() > 0.1  # one matrix of all experts is another update


def test_a_mixture_of_experts_equals_torch_muon_per_expert():
    """Each routed expert's matrix on torch.optim.Muon as its own 2-D parameter, the rest as in
    test_equals_torch_muon_and_adamw: every weight equal after 4 steps."""
    optim = OptimConfig(name="muon", fused="torch", weight_decay=0.1)
    model = tiny_moe()
    want = run_torch(copy.deepcopy(model), optim)
    got = run_megaft(model, optim)
    for name in got:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_equals_torch_muon_and_adamw(variant):
    optim = OptimConfig(name="muon", fused="torch", weight_decay=0.1)
    for k, v in VARIANTS[variant].items():
        setattr(optim.muon, k, v)
    model = tiny_model()
    want = run_torch(copy.deepcopy(model), optim)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = run_megaft(model, optim)
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name
        assert not torch.equal(got[name], start[name]), name  # every weight moved


def test_muon_is_not_adamw():
    """The Muon matrices move differently from an all-AdamW run (the test above could not pass
    with Muon silently replaced by AdamW; here the reverse is checked directly)."""
    model = tiny_model()
    optim = OptimConfig(name="muon", fused="torch")
    got = run_megaft(copy.deepcopy(model), optim)
    optim.muon.momentum = 0.0  # a different Muon: the momentum must matter
    other = run_megaft(model, optim)
    for name in muon_split(tiny_model())["muon"]:
        assert not torch.equal(got[name], other[name]), name


def test_master_weights_equal_torch_muon_on_fp32_copies():
    """optim.master_weights: bf16 params and grads, fp32 masters and momentum. After 4 steps every
    fp32 master equals torch.optim.Muon (+ torch.optim.AdamW) run on fp32 copies of the rounded init
    fed the same bf16 gradients upcast, bit for bit (the same fp32 ops on the same values), and every
    bf16 param is its master rounded to nearest even (holding less than it: the masters matter)."""
    optim = OptimConfig(name="muon", fused="torch", weight_decay=0.1, master_weights=True)
    model = tiny_model()
    ref = copy.deepcopy(model)
    for p in ref.parameters():  # the init FlatParams rounds to bf16, in fp32
        p.data = p.data.bfloat16().float()
    split = muon_split(model)
    flat = FlatParams(model, weight_decay=optim.weight_decay, device=torch.device("cpu"), dtype=torch.bfloat16,
                      **flat_split(split))
    opt = MuonAdamW(flat, optim, split=split)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    grads = []
    for ids, lr in zip(batches(), LRS):
        model.loss_sum(ids, ids).backward()
        grads.append({names[id(p)]: p.grad.float() for p in model.parameters()})  # bf16 grads, upcast
        opt.step(lr)
        opt.zero_grad()
    want = run_torch(ref, optim, feed=grads)
    masters = {}
    for group, master in zip(flat.groups, opt.masters):
        for p in group.params:
            at = (p.data.data_ptr() - group.data.data_ptr()) // group.data.element_size()
            masters[names[id(p)]] = (p.data, master[at:at + p.numel()].view_as(p))
    assert masters.keys() == want.keys() and len(muon_split(model)["muon"]) == 14
    for name, (param, master) in masters.items():
        assert master.dtype == torch.float32 and torch.equal(master, want[name]), name
        assert torch.equal(param, master.bfloat16()), name
    assert not all(torch.equal(p.float(), m) for p, m in masters.values())


def _muon_config(moe: bool = False, lora: bool = False, master: bool = False, mqa: bool = False, **par) -> Config:
    cfg = small_config(steps=6, micro=4)
    if mqa:  # one kv head: at tp=2 each rank holds a copy of it
        cfg.model.n_kv_heads = 1
    if master:  # bf16 params and grads, fp32 masters and momentum
        cfg.precision, cfg.optim.master_weights = "bf16", True
    if lora:  # adapters on every attention and MLP linear, rank 4 (a mixture of experts: its experts and router)
        cfg.lora.rank = 4
        cfg.lora.targets += ["experts", "router"] if moe else []
        # no held-out prompts: greedy eval under ep stops decoding per rank at its own eos and leaves the
        # other ep rank waiting in the experts' all-to-all (megaft.inference.generate._decode, not Muon's)
        cfg.data.task_eval_size = 0 if moe else cfg.data.task_eval_size
    if moe:  # Mixtral-shaped blocks: 4 routed experts, top-2
        cfg.model = dataclasses.replace(cfg.model, arch="mixtral", n_experts=4, top_k=2, moe_ffn_dim=64)
        cfg = resolve(cfg)
    cfg.optim.name = "muon"
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _fit_and_save(cfg: Config, grid: ParallelGrid, root: str, *, resume_at: int = 0) -> None:
    """Train, and save this rank's final weights (tp shards with their split) as weights{rank}.pt.
    `resume_at`: stop after that step's checkpoint, then finish in a fresh Trainer."""
    if resume_at:
        cfg.train.save_every = resume_at
        Trainer(cfg, grid, root).fit(stop_after=resume_at)
    trainer = Trainer(cfg, grid, root)
    trainer.fit()
    weights = {}
    with trainer.parts.optim.whole_params():  # ZeRO-3: every rank gathers
        for name, p in trainer.parts.model.named_parameters():
            spec = shard_of(p) if grid.tp_size > 1 else None
            weight, experts = p.detach().clone(), expert_slice_of(p)
            if experts is not None and experts.size > 1:  # ep: every rank's experts, whole
                weight = all_gather(weight.contiguous(), 0, experts.group)
            weights[name] = (weight, None if spec is None else (spec.dim, spec.full, getattr(spec, "replicas", 1)))
    torch.save(weights, os.path.join(root, f"weights{grid.rank}.pt"))


def _whole_weights(run_dir: str) -> dict[str, torch.Tensor]:
    """The whole weights from every rank's file: tp shards concatenated in rank order less the
    vocabulary's padding, pp stages' tensors united, copies (dp, tp-replicated, copied kv heads)
    checked equal."""
    files = sorted(f for f in os.listdir(run_dir) if f.startswith("weights"))
    held: dict[str, list] = {}
    for f in files:
        for name, item in torch.load(os.path.join(run_dir, f)).items():
            held.setdefault(name, []).append(item)
    out = {}
    for name, items in held.items():
        where = items[0][1]
        if where is None:
            assert all(torch.equal(t, items[0][0]) for t, _ in items), name
            out[name] = items[0][0]
        else:
            dim, full, copies = where
            parts = [t for t, _ in items]
            for i, t in enumerate(parts):  # tp > n_kv_heads: ranks i // copies hold one head, bit for bit
                assert torch.equal(t, parts[i - i % copies]), name
            out[name] = torch.cat(parts[::copies], dim=dim).narrow(dim, 0, full)
    return out


DP2 = {f"dp2_zero{z}": dict(dp=2, zero=z, bucket_mb=0.01) for z in (0, 1, 2)}
DP2["dp2_zero3"] = dict(dp=2, zero=3)  # one bucket per layer and decay class
MP2 = {"tp2": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2)}
LAYOUTS = [*DP2, *MP2]
# one kv head at tp=2 (copied on both ranks), against one process of that model
MQA = {"mqa_tp2": dict(tp=2)}
# mixtures of experts, against one process of the same model: experts split over ep (ZeRO 0 and 1:
# the expert buckets sharded over their own replicas), expert stacks split over tp
MOE = {"moe_dp2_ep2": dict(dp=2, ep=2), "moe_dp2_ep2_zero1": dict(dp=2, ep=2, zero=1, bucket_mb=0.01),
       "moe_tp2": dict(tp=2)}
# LoRA: only the adapters train, each A and B its own Muon matrix (column B and row A split over tp)
LORA = {"lora_tp2": dict(tp=2), "lora_dp2_zero1": dict(dp=2, zero=1, bucket_mb=0.01)}
# LoRA on the mixture of experts: the experts' adapters split over ep (ZeRO-1 over their replicas) or tp
MOE_LORA = {"moe_lora_dp2_ep2_zero1": dict(dp=2, ep=2, zero=1, bucket_mb=0.01), "moe_lora_tp2": dict(tp=2)}
RESUMED = {"single_resumed": dict(), "dp2_zero1_resumed": dict(dp=2, zero=1, bucket_mb=0.01)}  # after step 3
RESHARDED = dict(dp=2, zero=1, bucket_mb=0.01)  # saved after step 3 there, finished on one process
# optim.master_weights (bf16 params, fp32 masters and momentum), against one process of the same; resumed after step 3
MASTER = {"mw_dp2_zero1": dict(dp=2, zero=1, bucket_mb=0.01), "mw_tp2": dict(tp=2)}
# parallel.offload=cpu (momentum, masters and the AdamW state on the host): each against its run on the device
OFFLOAD = {"dp2_zero1_offload": dict(DP2["dp2_zero1"], offload="cpu"),
           "dp2_zero3_offload": dict(DP2["dp2_zero3"], offload="cpu"),
           "mw_dp2_zero1_offload": dict(MASTER["mw_dp2_zero1"], offload="cpu")}


def _train_parallel(rank: int, world: int, root: str) -> None:
    """dp=2 at ZeRO 0-3 (several buckets: matrices straddle two ranks' chunks), tp=2 (column and
    row shards), pp=2 (a layer per stage) and cp=2, one after the other."""
    for name, par in {**DP2, **MP2}.items():
        grid = layout_grid(par)
        _fit_and_save(_muon_config(**par), grid, os.path.join(root, name))
    _fit_and_save(_muon_config(**RESUMED["dp2_zero1_resumed"]), ParallelGrid.build(tp=1, dp=2, pp=1, device="cpu"),
                  os.path.join(root, "dp2_zero1_resumed"), resume_at=3)
    for name, par in MOE.items():
        _fit_and_save(_muon_config(moe=True, **par), layout_grid(par), os.path.join(root, name))
    for name, par in MQA.items():
        _fit_and_save(_muon_config(mqa=True, **par), layout_grid(par), os.path.join(root, name))
    for name, par in LORA.items():
        _fit_and_save(_muon_config(lora=True, **par), layout_grid(par), os.path.join(root, name))
    for name, par in MOE_LORA.items():
        _fit_and_save(_muon_config(moe=True, lora=True, **par), layout_grid(par), os.path.join(root, name))
    for name, par in MASTER.items():
        _fit_and_save(_muon_config(master=True, **par), layout_grid(par), os.path.join(root, name))
    for name, par in OFFLOAD.items():
        _fit_and_save(_muon_config(master=name.startswith("mw"), **par), layout_grid(par), os.path.join(root, name))
    par = OFFLOAD["mw_dp2_zero1_offload"]  # stopped after step 3, resumed into the host masters and momentum
    _fit_and_save(_muon_config(master=True, **par), layout_grid(par),
                  os.path.join(root, "mw_dp2_zero1_offload_resumed"), resume_at=3)
    _fit_and_save(_muon_config(master=True, **MASTER["mw_dp2_zero1"]), layout_grid(MASTER["mw_dp2_zero1"]),
                  os.path.join(root, "mw_dp2_zero1_resumed"), resume_at=3)
    cfg = _muon_config(**RESHARDED)  # its first 3 steps; the fixture finishes it on one process
    cfg.train.save_every = 3
    Trainer(cfg, ParallelGrid.build(tp=1, dp=2, pp=1, device="cpu"), os.path.join(root, "resharded")).fit(
        stop_after=3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    names = ("single", *LAYOUTS, *RESUMED, "resharded", "moe_single", *MOE, "lora_single", *LORA, "mw_single",
             *MASTER, "mw_dp2_zero1_resumed", "single_offload", *OFFLOAD,
             "mqa_single", *MQA, "moe_lora_single", *MOE_LORA,
             "mw_dp2_zero1_offload_resumed")
    for name in names:
        os.makedirs(root / name)
    _fit_and_save(_muon_config(), ParallelGrid.single(), str(root / "single"))
    _fit_and_save(_muon_config(moe=True), ParallelGrid.single(), str(root / "moe_single"))
    _fit_and_save(_muon_config(lora=True), ParallelGrid.single(), str(root / "lora_single"))
    _fit_and_save(_muon_config(master=True), ParallelGrid.single(), str(root / "mw_single"))
    _fit_and_save(_muon_config(offload="cpu"), ParallelGrid.single(), str(root / "single_offload"))
    _fit_and_save(_muon_config(mqa=True), ParallelGrid.single(), str(root / "mqa_single"))
    _fit_and_save(_muon_config(moe=True, lora=True), ParallelGrid.single(), str(root / "moe_lora_single"))
    _fit_and_save(_muon_config(), ParallelGrid.single(), str(root / "single_resumed"), resume_at=3)
    spawn(2, _train_parallel, str(root))
    _fit_and_save(_muon_config(), ParallelGrid.single(), str(root / "resharded"))  # resumes dp2's step-3 checkpoint
    return {name: str(root / name) for name in names}


@pytest.mark.parametrize("layout", [*LAYOUTS, "resharded", *MOE, *MQA])
def test_layout_equals_single_process(runs, layout):
    """dp=2 (2 micro-batches each): at ZeRO 0 every rank orthogonalises the same reduced gradient,
    at ZeRO 1-3 the owners of a matrix's chunks orthogonalise its all-gathered update; tp=2:
    each shard's update gathered whole over tp, orthogonalised, the rank's part kept; pp=2: each
    stage's matrices are whole (its micro-batches' grads add in another order); cp=2: the
    replicated weights' grads summed over cp, then as at ZeRO 0. dp adds
    the micro-batch gradients in another order than one process and tp splits the matmuls, so
    the losses agree to fp32 rounding (tests/test_dp.py's 1e-5). The weights: Newton-Schulz
    runs in bf16 (torch.optim.Muon's choice), where an fp32 rounding difference of its input
    flips bf16 roundings that its 5 matmul iterations carry on, so a Muon matrix may differ by a
    fraction of one step's update lr_t * scale per step; we allow a quarter of their sum
    (measured: 0.025-0.058 over these layouts). A wrong orthogonalisation (a shard alone, a stale
    momentum, AdamW in Muon's place) moves weights by whole steps (measured: the peers' ZeRO-3
    bug, every matrix on AdamW, 1.09, and its losses 6e-2 apart). The AdamW tensors differ only
    through the gradients the Muon matrices give them: 1% of the summed lr (measured: 0.0020-0.0040).
    `resharded`: dp=2 ZeRO-1 to step 3's checkpoint, resumed on one process (the momentum, in
    exp_avg's chunks, resharded whole) to step 6. `mqa_tp2`: one kv head, copied on both tp ranks;
    the gathered k/v update repeats its rows, each head is orthogonalised once (the [16, 64] matrix
    one process holds, not the [32, 64] of two copies) and both copies stay equal bit for bit."""
    reference = "moe_single" if layout in MOE else "mqa_single" if layout in MQA else "single"
    (single, _), (got_loss, _) = read_metrics(runs[reference]), read_metrics(runs[layout])
    assert len(single) == len(got_loss) == 6
    if layout == "resharded":  # it did resume: this attempt trained steps 4-6 only
        tokens = [json.load(open(os.path.join(runs[n], "summary.json")))["tokens"] for n in ("single", layout)]
        assert tokens[1] * 2 == tokens[0] > 0
    assert got_loss == pytest.approx(single, rel=1e-5)
    cfg = _muon_config()
    lr_sum = sum(lr_at(s, cfg.optim, cfg.train.max_steps) for s in range(cfg.train.max_steps))
    want, got = _whole_weights(runs[reference]), _whole_weights(runs[layout])
    with open(os.path.join(runs[reference], "summary.json")) as f:
        muon = set(json.load(f)["optimizer"]["muon"])
    assert len(muon) == 14 and got.keys() == want.keys()  # 2 blocks of 4 attention and 3 MLP or expert matrices
    for name, w in want.items():
        bound = 0.25 * lr_sum * update_scale(w.shape, "original") if name in muon else 0.01 * lr_sum
        assert (got[name] - w).abs().max() <= bound, name


@pytest.mark.exact  # make test runs it on a pinned CPU code path (docs/contributing.md)
@pytest.mark.parametrize("layout", [*LORA, *MOE_LORA])
def test_lora_layouts_equal_the_single_process(runs, layout):
    """LoRA adapters on Muon: tp=2 gathers a column linear's B and a row linear's A whole over tp
    before Newton-Schulz (the replicated halves are whole already); dp=2 ZeRO-1 orthogonalises the
    all-gathered update of adapters straddling two ranks' chunks. On the mixture of experts (targets
    + experts, router) each routed expert's A [r, in] and B [out, r] is a matrix of the [E, ...]
    adapter stacks, orthogonalised expert by expert: tp=2 gathers gate/up's B and down's A (split
    like their weights) whole, dp=2 ep=2 holds 2 experts' adapters per rank, sharded by ZeRO-1 over
    their replicas; the router's adapter is on AdamW. The bounds of test_layout_equals_single_process
    (bf16 Newton-Schulz; AdamW 1% of the summed lr), the base weights bitwise unchanged."""
    reference = "moe_lora_single" if layout in MOE_LORA else "lora_single"
    (single, _), (got_loss, _) = read_metrics(runs[reference]), read_metrics(runs[layout])
    # 1e-4, not the full fine-tune's 1e-5: the adapters' bf16 Newton-Schulz roundings carry into every
    # token's activations through the rank-4 product (measured 1.8e-5 at tp=2, step 6)
    assert len(single) == len(got_loss) == 6 and got_loss == pytest.approx(single, rel=1e-4)
    cfg = _muon_config()
    lr_sum = sum(lr_at(s, cfg.optim, cfg.train.max_steps) for s in range(cfg.train.max_steps))
    want, got = _whole_weights(runs[reference]), _whole_weights(runs[layout])
    with open(os.path.join(runs[reference], "summary.json")) as f:
        muon = set(json.load(f)["optimizer"]["muon"])
    assert got.keys() == want.keys()
    moved = 0
    for name, w in want.items():
        if ".adapter." in name:
            bound = 0.25 * lr_sum * update_scale(w.shape, "original") if name in muon else 0.01 * lr_sum
            assert (got[name] - w).abs().max() <= bound, name
            moved += int(name.endswith("B") and bool(w.abs().max() > 0))  # B starts at zero
        else:
            assert torch.equal(got[name], w), name
    # 2 blocks x 7 linears; on the mixture: 4 attention linears, 3 expert stacks and the router
    assert moved == (2 * 8 if layout in MOE_LORA else 14)


def _bf16_ulp(w: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at each element of `w` (8 significant bits: 2^(e-8) for |w| in [2^(e-1), 2^e))."""
    _, e = torch.frexp(w.float())
    return torch.ldexp(torch.ones_like(w, dtype=torch.float32), e - 8)


@pytest.mark.exact  # make test runs it on a pinned CPU code path (docs/contributing.md)
@pytest.mark.parametrize("layout", list(MASTER))
def test_master_weights_layouts_equal_the_single_process(runs, layout):
    """optim.master_weights (bf16 params, activations and grads; fp32 masters and momentum) at dp=2
    ZeRO-1 and tp=2 against one process of the same. The bound, derived: each layout rounds its
    bf16 matmuls and gradient sums differently (2^-8 relative a rounding, either sign); a step's
    loss is the mean of 512 tokens' losses, so the means differ by about 2^-8/sqrt(512) = 1.7e-4
    relative: we allow 5e-4 (measured up to 5.3e-5 at tp=2). A bf16 param is its master rounded,
    so a master difference far below a bf16 spacing can still flip one rounding: each weight may
    differ by one bf16 spacing at its value plus the masters' difference, which for a Muon matrix
    is test_layout_equals_single_process's argument (Newton-Schulz in bf16: its input, the fp32
    momentum of grads that now differ in bf16 roundings, flips roundings it carries on, a fraction
    of a step lr_t * scale per step): 0.3 of their sum (measured 0.12-0.15); an AdamW tensor's
    update lr_t m/sqrt(v) moves by a fraction of lr_t where its grad's bf16 rounding changes m/sqrt(v):
    0.25 of the summed lr (measured 0.010-0.081). A matrix orthogonalised from a shard, or a
    momentum or master lost, moves by whole steps (about 1 of the sums: the peers' ZeRO-3 bug
    measured 1.09 in the fp32 test)."""
    (single, _), (got_loss, _) = read_metrics(runs["mw_single"]), read_metrics(runs[layout])
    assert len(single) == len(got_loss) == 6 and got_loss == pytest.approx(single, rel=5e-4)
    cfg = _muon_config()
    lr_sum = sum(lr_at(s, cfg.optim, cfg.train.max_steps) for s in range(cfg.train.max_steps))
    want, got = _whole_weights(runs["mw_single"]), _whole_weights(runs[layout])
    with open(os.path.join(runs["mw_single"], "summary.json")) as f:
        muon = set(json.load(f)["optimizer"]["muon"])
    assert len(muon) == 14 and got.keys() == want.keys()
    for name, w in want.items():
        assert w.dtype == got[name].dtype == torch.bfloat16, name
        bound = 0.3 * lr_sum * update_scale(w.shape, "original") if name in muon else 0.25 * lr_sum
        assert ((got[name].float() - w.float()).abs() <= bound + _bf16_ulp(w)).all(), name


MEMORY = {"single": {}, "dp2_zero1": DP2["dp2_zero1"], "mw_single": {}, **MASTER, **OFFLOAD, "tp2": MP2["tp2"],
          "moe_dp2_ep2_zero1": MOE["moe_dp2_ep2_zero1"], "lora_tp2": LORA["lora_tp2"]}


@pytest.mark.parametrize("name", ["single", "dp2_zero1", "mw_single", "mw_dp2_zero1", "mw_dp2_zero1_offload", "tp2",
                                  "moe_dp2_ep2_zero1", "lora_tp2"])
def test_memory_estimate_equals_the_held_bytes(runs, name):
    """megaft-plan's memory estimate (megaft.perf.memory) of a Muon run equals the bytes its optimizer
    held (summary.json): a Muon element keeps one fp32 buffer (the momentum), an AdamW element two
    (4 + 4), and under master weights each beside its fp32 master (bf16 params and grads); under
    offload none of it on the device and on the host the masters, moments and the grads' host copy.
    1%: the flat buffers pad each bucket to a multiple of dp. The one-buffer rule is what is checked:
    a second buffer for the Muon matrices (AdamW's rule, estimated here by the same config under
    optim.name=adamw) would add more than 10% of the optimizer bytes at each of these layouts (the
    Muon matrices are most of the model: 2 x 7 matrices beside norms, biases, embedding and head)."""
    from megaft.perf.memory import estimate_ranks

    with open(os.path.join(runs[name], "summary.json")) as f:
        held = json.load(f)["memory_bytes"]
    par = MEMORY[name]
    world = 2 if par else 1
    cfg = _muon_config(master=name.startswith("mw"), moe=name.startswith("moe"), lora="lora" in name, **par)
    est = estimate_ranks(cfg, world)[0]
    if par.get("offload") == "cpu":  # nothing on the device: the state on the host, beside the grads' fp32 copies
        assert est.optimizer == held["optimizer"] == 0
        assert held["host"]["grads"] == pytest.approx(4 * (est.params // 2) / world, rel=0.01)  # bf16 params
        cfg.parallel.offload = "none"  # the same state bytes, on the device
        est = dataclasses.replace(est, optimizer=estimate_ranks(cfg, world)[0].optimizer)
        held = dict(held, optimizer=held["host"]["optimizer"])
    cfg.optim.name = "adamw"
    two_buffers = estimate_ranks(cfg, world)[0].optimizer
    assert two_buffers - est.optimizer > 0.1 * est.optimizer  # what a second buffer would add
    # LoRA: the run's params are its trainable flat buffers; the estimate's include the frozen base
    for part in ("grads", "optimizer") if "lora" in name else ("params", "grads", "optimizer"):
        assert held[part] == pytest.approx(getattr(est, part), rel=0.01), (part, held, est)


@pytest.mark.parametrize("offloaded", ["single_offload", *OFFLOAD])
def test_offload_is_bitwise_the_device_run(runs, offloaded):
    """parallel.offload=cpu: the Muon momentum (and under master weights the fp32 masters) live on
    the host beside AdamW's state; the grads come down, the momentum and update are computed there,
    the update goes up for Newton-Schulz (and the tp or ZeRO gathers) on the device, and the
    orthogonalised result is applied to the host master, which the param copies. On a CPU device
    these are the same fp32 ops on the same values (AdamW's kernel on the same element ranges), so
    the curve and every weight equal the run without offload bit for bit: at zero 0, ZeRO-1 and
    ZeRO-3 in fp32, and ZeRO-1 with master weights."""
    straight = runs[offloaded.removesuffix("_offload")] if offloaded != "single_offload" else runs["single"]
    got, want = read_metrics(runs[offloaded])[0], read_metrics(straight)[0]
    assert len(got) == 6 and got == want
    got, want = _whole_weights(runs[offloaded]), _whole_weights(straight)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    with open(os.path.join(runs[offloaded], "summary.json")) as f:
        held = json.load(f)["memory_bytes"]
    assert held["optimizer"] == 0 and held["host"]["optimizer"] > 0  # the state is on the host


def test_lora_adapters_equal_torch_muon():
    """Adapters on every attention and MLP linear of tiny_model (base frozen): each A and B is a
    2-D parameter of torch.optim.Muon; every tensor bitwise equal after 4 steps."""
    from megaft.peft.lora import apply_lora

    optim = OptimConfig(name="muon", fused="torch", weight_decay=0.1)
    model = apply_lora(tiny_model(), LoraConfig(rank=4), seed=1, tp_rank=0, tp_size=1)
    split = muon_split(model)
    assert not split["adamw"] and len(split["muon"]) == 28 and all(".adapter." in n for n in split["muon"])
    want = run_torch(copy.deepcopy(model), optim)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = run_megaft(model, optim)
    for name in got:
        assert torch.equal(got[name], want[name]), name
        assert torch.equal(got[name], start[name]) == (".adapter." not in name), name  # only adapters move


def test_moe_lora_adapters_equal_torch_muon_per_expert():
    """LoRA on tiny_moe with every target (attention, the routed experts, the router): each expert's
    A [r, in] and B [out, r] is its own matrix, orthogonalised in one batched pass over the [E, ...]
    adapter stacks and checked against torch.optim.Muon given each expert's adapter as a 2-D
    parameter (a per-expert loop); the router's adapter stays on AdamW as the router does. Every
    tensor bitwise equal after 4 steps, and only the adapters move."""
    from megaft.peft.lora import apply_lora

    optim = OptimConfig(name="muon", fused="torch", weight_decay=0.1)
    lora = LoraConfig(rank=4, targets=["q", "k", "v", "o", "experts", "router"])
    model = apply_lora(tiny_moe(), lora, seed=1, tp_rank=0, tp_size=1)
    split = muon_split(model)
    stacks = {n: p.shape for n, p in split["muon"].items() if p.dim() == 3}
    assert sorted(split["adamw"]) == [f"layers.{i}.mlp.gate.adapter.{ab}" for i in range(2) for ab in "AB"]
    assert len(stacks) == 2 * 3 * 2 and all(".mlp.experts.adapter." in n and s[0] == 4 for n, s in stacks.items())
    assert len(split["muon"]) == len(stacks) + 2 * 4 * 2  # + q, k, v, o's A and B in each block
    with torch.no_grad():  # B starts at zero: a nonzero start makes every expert's A see its own gradient
        for n, p in model.named_parameters():
            if n.endswith(".adapter.B"):
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    want = run_torch(copy.deepcopy(model), optim)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = run_megaft(model, optim)
    for name in got:
        assert torch.equal(got[name], want[name]), name
        assert torch.equal(got[name], start[name]) == (".adapter." not in name), name  # only adapters move


@pytest.mark.parametrize("resumed,straight", [("single_resumed", "single"), ("dp2_zero1_resumed", "dp2_zero1"),
                                              ("mw_dp2_zero1_resumed", "mw_dp2_zero1"),
                                              ("mw_dp2_zero1_offload_resumed", "mw_dp2_zero1_offload")])
def test_resume_is_bitwise(runs, resumed, straight):
    """Stopped after step 3's checkpoint and finished in a fresh Trainer: the Muon momentum (in
    the checkpoint's exp_avg) comes back, and under master weights the fp32 masters (the bf16
    params alone would lose their low bits; under offload into the host buffers), so the curve and
    every weight equal the straight run's."""
    assert read_metrics(runs[resumed])[0] == read_metrics(runs[straight])[0]  # steps 1-3 logged before the stop
    got, want = _whole_weights(runs[resumed]), _whole_weights(runs[straight])
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_two_buffer_checkpoint_resumes_bitwise(runs, tmp_path, monkeypatch):
    """A checkpoint saved before the Muon matrices had buffers of their own (their momentum in the
    decayed buffer's exp_avg, a zero exp_avg_sq beside it: the optimizer built without FlatParams'
    momentum_only, as megaft did then) still loads: its buffer layout differs, so it goes through the
    resharding path, which reads the momentum by parameter name and drops the zero second moment. The
    run finished from it equals the straight run bit for bit (curve and every weight), and the one it
    saved has no second moment for the Muon matrices."""
    import megaft.optim.muon
    import megaft.training.optimizer

    root = str(tmp_path)
    with monkeypatch.context() as old:  # the optimizer as it was: Muon matrices among the AdamW tensors
        old.setattr(megaft.training.optimizer, "flat_split", lambda split: {})
        old.setattr(megaft.optim.muon, "momentum_only_ids", lambda flat, split: {id(p) for p in split["muon"].values()})
        cfg = _muon_config()
        cfg.train.save_every = 3
        trainer = Trainer(cfg, ParallelGrid.single(), root)
        trainer.fit(stop_after=3)
        assert not any(g.momentum_only for g in trainer.parts.optim.flat.groups)
        assert trainer.parts.optim.optimizer.memory_bytes()["optimizer"] == 8 * sum(
            g.data.numel() for g in trainer.parts.optim.flat.groups)  # two buffers
    cfg = _muon_config()
    cfg.train.save_every = 3
    _fit_and_save(cfg, ParallelGrid.single(), root)
    assert read_metrics(root)[0] == read_metrics(runs["single"])[0]
    got, want = _whole_weights(root), _whole_weights(runs["single"])
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    saved = io.load_shard(io.step_dir(os.path.join(root, "checkpoints"), 6), 0)
    # the Muon matrices' buffer: its momentum saved, no second moment (the AdamW buffers keep theirs)
    assert [v.numel() == 0 for v in saved["exp_avg_sq"]].count(True) == 1
    assert all(m.abs().max() > 0 for m in saved["exp_avg"])


def test_summary_records_the_split(runs):
    for name, run_dir in runs.items():
        with open(os.path.join(run_dir, "summary.json")) as f:
            rec = json.load(f)["optimizer"]
        if name.startswith("lora"):  # only the adapters train: 2 blocks x 7 linears x (A, B), all on Muon
            assert rec["muon_params"] == 28 and rec["adamw_params"] == 0, rec
            assert all(n.endswith((".adapter.A", ".adapter.B")) for n in rec["muon"]), rec["muon"]
            continue
        if name.startswith("moe_lora"):  # 2 blocks x (4 attention adapters + 3 expert stacks) x (A, B); routers'
            assert rec["muon_params"] == 28 and rec["adamw"] == [f"layers.{i}.mlp.gate.adapter.{ab}"
                                                                 for i in range(2) for ab in "AB"], rec
            continue
        routers = 2 if name.startswith("moe") else 0  # a MoE block's router stays on AdamW
        assert rec["name"] == "muon" and rec["muon_params"] == 14 and rec["adamw_params"] == 7 + routers  # 2 x 7
        assert rec["muon_params"] == len(rec["muon"]) and "lm_head.weight" in rec["adamw"]


def test_adamw_summary_has_no_optimizer_record():
    """AdamW runs' summary.json stays as it was: the field is left out when unset."""
    assert "optimizer" not in RunSummary().to_json()
    assert RunSummary(optimizer={"name": "muon"}).to_json()["optimizer"] == {"name": "muon"}


def test_every_layout_runs_under_muon():
    """No layout is refused any more: copied kv heads (tp=4 over model.n_kv_heads=2), master weights
    with offload, dense LoRA at tp=2 and LoRA on a mixture of experts validate without a Muon problem."""
    for cfg, world in ((_muon_config(tp=4), 4), (_muon_config(master=True, dp=2, zero=1, offload="cpu"), 2),
                       (_muon_config(tp=2), 2), (_muon_config(lora=True, tp=2), 2),
                       (_muon_config(moe=True, lora=True, dp=2, ep=2), 2)):
        assert not [p for p in validate(cfg, world) if "muon" in p], cfg.parallel
