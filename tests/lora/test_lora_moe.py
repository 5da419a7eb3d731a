"""LoRA on mixtures of experts (issue 26): per-expert adapters on the routed experts, adapters
on the shared expert and the router, against the single process and peft.

One spawn of 2 ranks trains two layouts of a tiny Qwen2-MoE (experts, shared expert and
router adapted, plus attention and the dense layer's MLP): dp=2·ep=2 with ZeRO-1 and tp=2 with
sequence parallel. Each equals the single process (loss, grad norm and aux_loss per step, every
adapter's step-1 gradient, the experts' joined over ep) and exports the same adapters: the
peer bugs Megatron-Bridge#5634 (adapters on experts split over tp) and #5484 (the adapter
layout changes with the ep degree). The ep=2 run's step-1 checkpoint resumes in one process
(ep=1) with the uninterrupted losses, and every layout's adapter state bytes equal
megaft.perf.memory's. The single process's export loads in peft onto transformers' model with
megaft's logits, and its merged export in transformers."""
from __future__ import annotations

import json
import os
import shutil

import peft
import pytest
import torch
from models.arch_fixture import make_hf
from models.moe_fixture import load_reference, make_hf_moe, sample_ids
from multirank import spawn
from safetensors.torch import load_file

from lora.lora_fixture import megaft_lora_model, write_data
from lora.lora_moe_cases import LAYOUTS, STEPS, layouts_rank, lora_moe_config
from megaft.config.lora import LoraConfig, check_lora, check_lora_moe
from megaft.parallel.grid import ParallelGrid
from megaft.perf.memory import estimate_ranks
from megaft.training.loop import Trainer
from megaft.verify.compare import compare
from megaft.verify.run import step1_grads

# fp32 logits of magnitude ~3: megaft and transformers/peft differ in summation order only (~3e-6 measured)
ATOL = 2e-5
# the exported adapters after 3 steps: AdamW's first steps move each element by ~lr whatever the
# gradient's size, so a gradient differing in its last bits (another summation order) moves
# tiny elements apart by up to ~1e-6; 1e-5 of lr=1e-2 is far below any layout bug's error
EXPORT_ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single process and both 2-rank layouts, trained and exported."""
    root = tmp_path_factory.mktemp("lora_moe")
    ckpt, data = str(root / "ckpt"), write_data(root / "train.jsonl")
    make_hf_moe(ckpt, "qwen2_moe")
    cfg = lora_moe_config(ckpt, data, export_merged=True)
    os.makedirs(root / "single")
    single = Trainer(cfg, ParallelGrid.single(), str(root / "single"))
    single.fit()
    spawn(2, layouts_rank, ckpt, data, str(root))
    return cfg, single, str(root)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_the_single_process(runs, layout):
    cfg, _, root = runs
    user, ref = os.path.join(root, layout), os.path.join(root, "single")
    beta1 = cfg.optim.beta1
    grads = step1_grads(user, beta1)
    report = compare(os.path.join(user, "metrics.jsonl"), os.path.join(ref, "metrics.jsonl"), grads,
                     step1_grads(ref, beta1), cfg.verify.tolerances())
    assert report.passed, report.format()
    assert [r.step for r in report.rows] == list(range(1, STEPS + 1))
    names = [n for n, _ in report.grads]  # the adapters of every kind were compared
    for part in ("mlp.experts.adapter.gate_proj.A", "mlp.experts.adapter.down_proj.B", "mlp.gate.adapter.A",
                 "mlp.shared_expert.gate_proj.adapter.B", "layers.1.mlp.down_proj.adapter.A"):
        assert any(part in n for n in names), (part, names)
    assert grads["layers.0.mlp.experts.adapter.up_proj.B"].shape == (4, 32, 4)  # [E, F, r]: whole, joined


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_does_not_depend_on_the_layout(runs, layout):
    """Megatron-Bridge#5484 (ep) and #5634 (tp): the same training exports the same adapters."""
    _, _, root = runs
    want = load_file(os.path.join(root, "single", "hf", "adapter_model.safetensors"))
    got = load_file(os.path.join(root, layout, "hf", "adapter_model.safetensors"))
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], atol=EXPORT_ATOL, rtol=0, msg=name)
    same = [json.load(open(os.path.join(root, d, "hf", "adapter_config.json"))) for d in ("single", layout)]
    assert same[0] == same[1]


@pytest.mark.parametrize("layout", ["single", *LAYOUTS])
def test_state_bytes_equal_the_formula(runs, layout):
    """Rank 0's measured adapter state (summary.json) equals megaft.perf.memory's: at ep=2 the
    expert adapters' moments shard over the dp*cp/ep = 1 ranks holding those experts, not over dp."""
    cfg, _, root = runs
    if layout != "single":
        cfg = lora_moe_config(cfg.model.init_from, cfg.data.path, **LAYOUTS[layout])
    measured = json.load(open(os.path.join(root, layout, "summary.json")))["memory_bytes"]
    est = estimate_ranks(cfg, cfg.launcher.nproc)[0]
    assert (measured["grads"], measured["optimizer"]) == (est.grads, est.optimizer), (measured, est)


def test_an_ep2_checkpoint_resumes_at_ep1(runs, tmp_path):
    """The ep2 layout's step-1 checkpoint (expert adapters and their ZeRO-1 moments split over
    ep: megaft.checkpoint.reshard joins them by name and expert index) resumed by one process:
    steps 2-3 give the uninterrupted runs' losses and the single process's adapters."""
    cfg, single, root = runs
    run = tmp_path / "resumed"
    shutil.copytree(os.path.join(root, "ep2", "checkpoints", "step_000001"), run / "checkpoints" / "step_000001")
    manifest = json.load(open(run / "checkpoints" / "step_000001" / "manifest.json"))
    assert manifest["layout"]["ep"] == 2  # saved split over ep
    one = lora_moe_config(cfg.model.init_from, cfg.data.path)
    one.train.export_hf = False
    resumed = Trainer(one, ParallelGrid.single(), str(run))
    resumed.fit()
    got = _losses(run)
    assert sorted(got) == [2, 3]
    for ref in ("ep2", "single"):
        want = _losses(os.path.join(root, ref))
        for step, loss in got.items():
            assert abs(loss - want[step]) <= 1e-5 * abs(want[step]), (ref, step, loss, want[step])
    trained = dict(single.parts.model.named_parameters())
    names = [n for n, p in resumed.parts.model.named_parameters() if p.requires_grad]
    assert any("mlp.experts.adapter.down_proj.B" in n for n in names), names
    for name in names:  # the moments came back too: step 3's update lands where the single process's did
        p = dict(resumed.parts.model.named_parameters())[name]
        assert p.shape == trained[name].shape, name
        torch.testing.assert_close(p, trained[name], atol=EXPORT_ATOL, rtol=0, msg=name)


def _losses(run) -> dict[int, float]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_export_loads_in_peft_and_merged_in_transformers(runs):
    cfg, single, root = runs
    adapter_dir, merged_dir = os.path.join(root, "single", "hf"), os.path.join(root, "single", "hf_merged")
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["target_parameters"] == [
        "mlp.down_proj.weight", "mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "shared_expert.down_proj.weight",
        "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight"]
    assert config["rank_pattern"] == {"gate_up_proj": 8} and config["alpha_pattern"] == {"gate_up_proj": 16.0}
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    experts = "base_model.model.model.layers.0.mlp.experts"
    assert saved[f"{experts}.base_layer.lora_A.weight"].shape == (4 * 8, 64)  # gate|up: [E 2r, dim]
    assert saved[f"{experts}.lora_B.weight"].shape == (64, 4 * 4)  # down: [dim, r E]
    ids = sample_ids()
    model = single.parts.model.eval()
    with torch.no_grad():
        ours = model(ids)[..., :load_reference(cfg.model.init_from).config.vocab_size]
        plain = load_reference(cfg.model.init_from)(ids).logits
        loaded = peft.PeftModel.from_pretrained(load_reference(cfg.model.init_from), adapter_dir).eval()
        merged = load_reference(merged_dir)
        assert (ours - plain).abs().max() > 1e-2  # training moved the logits
        torch.testing.assert_close(loaded(ids).logits, ours, atol=ATOL, rtol=0)
        torch.testing.assert_close(merged(ids).logits, ours, atol=ATOL, rtol=0)
    files = load_file(os.path.join(merged_dir, "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in files  # the published per-expert layout
    assert not any("lora" in k or "adapter" in k for k in files)


def test_moe_targets_are_validated_with_their_fix(tmp_path):
    problems = check_lora(LoraConfig(rank=4, targets=["q", "router"], dropout=0.1), precision="fp32")
    assert any("router without experts" in p and "fix: add experts" in p for p in problems), problems
    assert any("lora.dropout=0.1" in p and "fix: lora.dropout=0" in p for p in problems), problems
    problems = check_lora_moe(LoraConfig(rank=4, targets=["experts", "router", "shared_expert"]), n_experts=0,
                              shared_expert=False)
    assert any("['experts', 'router'] but the model is dense" in p and "fix: drop experts and router" in p
               for p in problems), problems
    assert any("shared_expert but the model has no shared expert" in p and "fix:" in p for p in problems)
    dense = str(tmp_path / "dense")
    make_hf(dense, "llama3")
    with pytest.raises(ValueError, match="model is dense.*fix: drop experts"):  # the model build refuses too
        megaft_lora_model(dense, LoraConfig(rank=4, targets=["q", "experts"]))
