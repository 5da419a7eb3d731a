"""LoRA on one process (issue 15): megaft's adapted forward equals peft's on the same
adapters; a LoRA run freezes the base (no grad, no optimizer state, bitwise unchanged) and
moves every adapter; its checkpoints hold the adapters only and name their base (another
base is refused); an interrupted run resumes bitwise; the export loads in peft and, merged,
in transformers with the same logits as megaft's model."""
from __future__ import annotations

import json
import math
import os
import shutil

import peft
import pytest
import torch
from models.arch_fixture import VOCAB, load_reference, make_hf, sample_ids
from safetensors.torch import load_file

from lora.lora_fixture import TARGETS, lora_config, megaft_lora_model, peft_state, randomize_adapters, write_data
from megaft.checkpoint.adapters import BaseMismatchError
from megaft.config import Config
from megaft.config.lora import check_lora
from megaft.models.hf.config import hf_name
from megaft.parallel.grid import ParallelGrid
from megaft.peft.export import peft_name
from megaft.peft.lora import adapters
from megaft.perf.counts import matmul_params
from megaft.perf.memory import estimate_memory
from megaft.training.loop import Trainer
from megaft.validation import validate

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# fp32 logits of magnitude ~3: megaft and transformers/peft differ only in summation order
# (fused residual adds, SDPA vs eager attention), ~2e-6 measured.
ATOL = 1e-5


def _peft_model(ckpt: str, rslora: bool, state: dict[str, torch.Tensor]):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=HF_TARGETS, use_rslora=rslora, init_lora_weights=False)
    model = peft.get_peft_model(load_reference(ckpt), cfg)
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            own[name.replace(".weight", ".default.weight")].copy_(value)
    return model.eval()


@pytest.mark.parametrize("arch,rslora", [("llama3", False), ("qwen2", True), ("gemma", False), ("gemma2", False),
                                         ("gemma3", True)])
def test_forward_equals_peft(tmp_path, arch, rslora):
    ckpt = str(tmp_path / "ckpt")
    make_hf(ckpt, arch)
    ours = megaft_lora_model(ckpt, lora_config(rslora=rslora))
    randomize_adapters(ours)
    theirs = _peft_model(ckpt, rslora, peft_state(ours, ours.cfg.arch))
    ids = sample_ids()
    with torch.no_grad():
        got, want, plain = ours(ids)[..., :VOCAB], theirs(ids).logits, load_reference(ckpt)(ids).logits
    assert (want - plain).abs().max() > 0.1  # the adapters move the logits: the comparison means something
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_check_lora_reports_each_problem_with_a_fix():
    cfg = lora_config(rank=-1, alpha=0, dropout=1.0, targets=["q", "qkv", "q", "lm_head"], base_dtype="bf16",
                      export_merged=True)
    problems = check_lora(cfg, precision="fp32", fused_linear_cross_entropy=True, zero=3, export_hf=False)
    assert len(problems) == 9 and all("fix:" in p for p in problems), problems
    assert check_lora(lora_config(rank=0, alpha=-1), precision="fp32") == []  # off: nothing checked


def test_model_dependent_lora_problems_are_found_before_launch(tmp_path):
    """A tied head as a target, and k/v adapters when tp copies kv heads: refused by
    validate() (before any rank starts), not first when a rank builds the model."""
    ckpt = str(tmp_path / "tied")
    make_hf(ckpt, "llama3_tied")  # tied embeddings, 2 kv heads
    cfg = Config()
    cfg.model.init_from, cfg.data.path = ckpt, write_data(tmp_path / "train.jsonl")
    cfg.data.seq_len = 16
    cfg.parallel.tp, cfg.lora = 4, lora_config(targets=["q", "v", "lm_head"])
    problems = validate(cfg, 4)
    assert any("lm_head" in p and "ties" in p and "fix:" in p for p in problems), problems
    assert any("['v']" in p and "parallel.tp=4" in p and "2 kv heads" in p for p in problems), problems
    cfg.parallel.tp, cfg.lora = 2, lora_config(targets=["q", "v"])  # tp within the kv heads: fine
    assert validate(cfg, 2) == []
    # a model built without validate() (the Python API) is refused with the same message
    with pytest.raises(ValueError, match="ties its embeddings.*fix: drop lm_head"):
        megaft_lora_model(ckpt, lora_config(targets=["q", "lm_head"]))


def run_config(ckpt: str, data: str, *, export: bool = False, precision: str = "fp32", **lora) -> Config:
    cfg = Config()
    cfg.model.init_from = ckpt
    cfg.data.path, cfg.data.seq_len = data, 16
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 8
    cfg.train.max_steps, cfg.train.eval_every, cfg.train.save_every, cfg.train.keep_last = 6, 6, 3, 0
    cfg.train.progress, cfg.train.tensorboard = False, "false"
    cfg.parallel.tp = cfg.launcher.nproc = 1
    cfg.optim.lr = 1e-2
    cfg.train.export_hf, cfg.precision = export, precision
    cfg.lora = lora_config(dropout=0.1, export_merged=export, **lora)
    assert validate(cfg, 1) == []
    return cfg


def train(cfg: Config, run_dir: str, stop_after=None) -> Trainer:
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, ParallelGrid.single(), run_dir)
    trainer.fit(stop_after=stop_after)
    return trainer


def losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One exported 6-step LoRA run (checkpoints at 3 and 6) of a random llama3 base."""
    root = tmp_path_factory.mktemp("lora_run")
    ckpt = str(root / "ckpt")
    make_hf(ckpt, "llama3")
    cfg = run_config(ckpt, write_data(root / "train.jsonl"), export=True)
    trainer = train(cfg, str(root / "run"))
    return cfg, trainer, str(root / "run")


def test_base_is_frozen_and_only_adapters_train(tmp_path, trained):
    cfg, trainer, _ = trained
    model, base = trainer.parts.model, load_file(os.path.join(cfg.model.init_from, "model.safetensors"))
    names = {id(p): n for n, p in model.named_parameters()}
    adapter_params = [p for _, a in adapters(model) for p in (a.A, a.B)]
    assert len(adapter_params) == 2 * len(TARGETS) * cfg.model.n_layers
    assert {id(p) for p in trainer.parts.optim.flat.params} == {id(p) for p in adapter_params}
    for name, p in model.named_parameters():
        if ".adapter." in name:
            continue
        assert not p.requires_grad and p.grad is None, name
        assert torch.equal(p.detach(), base[hf_name(name, cfg.model.arch)]), f"{name} changed"  # bitwise
    init = dict(adapters(Trainer(cfg, ParallelGrid.single(), str(tmp_path)).parts.model))  # a new run: the seeded init
    for name, a in adapters(model):  # B starts at 0, A at its seeded init: both moved
        assert a.B.abs().max() > 0 and not torch.equal(a.A, init[name].A), name
    # fp32 params + grads + two Adam moments of the adapters only (one flat buffer each, no padding at dp=1)
    n = sum(p.numel() for p in adapter_params)
    held = trainer.parts.optim.memory_bytes()
    assert held["optimizer"] == 8 * n and held["params"] == 4 * n and held["grads"] == 4 * n
    assert n < sum(p.numel() for p in model.parameters()) / 10
    assert all(names[id(p)].endswith((".A", ".B")) for p in trainer.parts.optim.flat.params)
    # the memory estimate (megaft.perf.memory) counts the same: adapter state, frozen base weights only
    est, frozen = estimate_memory(cfg, 1), sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    assert (est.optimizer, est.grads, est.params) == (8 * n, 4 * n, frozen + 4 * n)
    # MFU's FLOPs (megaft.perf.counts): no weight gradient for the frozen base, 6 per adapter parameter
    attention = 12 * cfg.model.n_layers * cfg.model.n_heads * cfg.model.hd * cfg.data.seq_len
    assert trainer.flops_per_token == 4 * matmul_params(cfg.model) + 6 * n + attention


def test_checkpoint_holds_adapters_and_names_its_base(trained):
    cfg, _, run_dir = trained
    step = os.path.join(run_dir, "checkpoints", "step_000006")
    manifest = json.load(open(os.path.join(step, "manifest.json")))
    assert manifest["lora"]["base"] == os.path.abspath(cfg.model.init_from)
    assert len(manifest["lora"]["base_fingerprint"]) == 64 and manifest["lora"]["rank"] == 4
    shard = torch.load(os.path.join(step, "rank_00000.pt"), weights_only=False)
    index = [e["name"] for group in shard["index"] for e in group]
    assert index and all(".adapter." in n for n in index)
    n = sum(p.numel() for p in shard["params"])
    assert n == sum(math.prod(e["shape"]) for g in shard["index"] for e in g)  # nothing but the adapters


def test_interrupted_run_resumes_bitwise_and_another_base_is_refused(tmp_path, trained):
    cfg, _, full_dir = trained
    cfg = run_config(cfg.model.init_from, cfg.data.path)
    run = str(tmp_path / "run")
    train(cfg, run, stop_after=3)
    train(cfg, run)
    assert losses(run) == losses(full_dir)  # dropout masks too: the RNG state is in the checkpoint
    other = str(tmp_path / "other")
    make_hf(other, "llama3", seed=1)  # same architecture and file sizes, other weights
    with pytest.raises(BaseMismatchError, match="another base model.*fix: set model.init_from"):
        train(run_config(other, cfg.data.path), run)


def test_export_loads_in_peft_and_merged_in_transformers(trained):
    cfg, trainer, run_dir = trained
    adapter_dir, merged_dir = os.path.join(run_dir, "hf"), os.path.join(run_dir, "hf_merged")
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert sorted(config["target_modules"]) == sorted(HF_TARGETS) and config["r"] == 4 and config["lora_alpha"] == 8
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved
    assert set(saved) == {peft_name(f"{m}.adapter.{w}", "llama") for m, _ in adapters(trainer.parts.model)
                          for w in ("A", "B")}
    ids = sample_ids()
    model = trainer.parts.model.eval()
    with torch.no_grad():
        ours = model(ids)[..., :VOCAB]
        loaded = peft.PeftModel.from_pretrained(load_reference(cfg.model.init_from), adapter_dir).eval()
        merged = load_reference(merged_dir)
        plain = load_reference(cfg.model.init_from)(ids).logits
        assert (ours - plain).abs().max() > 1e-2  # training moved the logits
        torch.testing.assert_close(loaded(ids).logits, ours, atol=ATOL, rtol=0)
        torch.testing.assert_close(merged(ids).logits, ours, atol=ATOL, rtol=0)
    assert not any("lora" in k or "adapter" in k for k in load_file(os.path.join(merged_dir, "model.safetensors")))
    assert os.path.isfile(os.path.join(adapter_dir, "tokenizer.json"))
    shutil.rmtree(merged_dir)


def test_bf16_base_halves_the_frozen_linears_and_trains(tmp_path, trained):
    cfg, _, full_dir = trained
    cfg = run_config(cfg.model.init_from, cfg.data.path, precision="bf16", base_dtype="bf16")
    cfg.train.max_steps, cfg.train.save_every = 2, 0
    trainer = train(cfg, str(tmp_path / "run"))
    dtypes = {n: p.dtype for n, p in trainer.parts.model.named_parameters()}
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if n.endswith("proj.weight") or n == "lm_head.weight")
    assert all(d == torch.float32 for n, d in dtypes.items() if ".adapter." in n or "norm" in n or "embed" in n)
    assert not any(p.requires_grad for n, p in trainer.parts.model.named_parameters() if ".adapter." not in n)
    frozen = sum(p.nbytes for p in trainer.parts.model.parameters() if not p.requires_grad)
    n = sum(p.numel() for p in trainer.parts.optim.flat.params)
    assert estimate_memory(cfg, 1).params == frozen + 4 * n  # the estimate counts the bf16 base too
    # bf16 compute and weights against the fp32 run: same first loss to bf16 rounding (~1e-2 relative)
    first, want = losses(str(tmp_path / "run"))[1], losses(full_dir)[1]
    assert abs(first - want) <= 2e-2 * want, (first, want)
