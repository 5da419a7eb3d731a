"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers, one
process: logits, the training loss with the load-balancing term, every gradient (router
included), the published per-expert file layout on export, transformers 5's fused in-memory
layout on import, and the config errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megaft.config.model import ModelConfig
from megaft.models.arch.spec import HFConfigError
from megaft.models.checks import check_model
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.export import export_hf
from megaft.models.hf.load import load_hf_weights
from models.hf_fixture import checkpoint_tensors
from models.moe_fixture import MOE_ARCHS, hf_grad_of, load_reference, make_hf_moe, sample_ids


def _megaft(path: str) -> Decoder:
    model = Decoder(hf_model_config(path))
    load_hf_weights(model, path, tp_rank=0, tp_size=1)
    return model


def _labels(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1)


@pytest.mark.parametrize("name", sorted(MOE_ARCHS))
def test_family_equals_transformers_logits_loss_aux_and_every_gradient(tmp_path, name):
    make_hf_moe(str(tmp_path), name)
    ref, model = load_reference(str(tmp_path)), _megaft(str(tmp_path))
    assert model.cfg.arch == name and model.cfg.n_experts == 4 and model.cfg.top_k == 2
    ids = sample_ids()
    with torch.no_grad():
        assert torch.allclose(model(ids), ref(ids).logits, atol=1e-5, rtol=1e-5)
    labels = _labels(ids)
    loss = model.loss_sum(ids, labels) / (labels != -100).sum()
    router = model.router_losses()
    out = ref(ids, labels=ids, output_router_logits=True)  # transformers shifts the labels itself
    assert router.aux.item() == pytest.approx(out.aux_loss.item(), rel=1e-6)
    total = loss + router.local  # router_aux_loss_coef x aux (z-loss off, as in transformers)
    assert total.item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert router.counts.sum().item() == ids.numel() * 2 * sum(model.cfg.is_moe(i) for i in range(model.cfg.n_layers))
    total.backward()
    out.loss.backward()
    hf_grads = {n: p.grad for n, p in ref.named_parameters()}
    for pname, p in model.named_parameters():
        want = hf_grad_of(hf_grads, pname, name)
        assert (p.grad - want).abs().max() <= 1e-5 * want.abs().max(), pname
    assert any(".mlp.gate." in n for n, _ in model.named_parameters())  # the router's gradient was compared


@pytest.mark.parametrize("name", sorted(MOE_ARCHS))
def test_export_writes_the_published_layout_that_transformers_reloads(tmp_path, name):
    src, out = tmp_path / "src", tmp_path / "out"
    make_hf_moe(str(src), name)
    model = _megaft(str(src))
    export_hf(model, model.cfg, str(out), tokenizer_json=str(src), tp_group=None, is_writer=True)
    written, published = checkpoint_tensors(str(out)), checkpoint_tensors(str(src))
    assert sorted(written) == sorted(published)  # per expert: experts.E.w1/w2/w3 (Mixtral), {gate,up,down}_proj
    assert all(torch.equal(written[k], published[k]) for k in published)
    config = json.load(open(out / "config.json"))
    assert config["model_type"] == name and config["num_experts_per_tok"] == 2
    ids = sample_ids(1)
    with torch.no_grad():
        assert torch.allclose(load_reference(str(out))(ids).logits, load_reference(str(src))(ids).logits, atol=0)


def test_fused_in_memory_layout_imports_like_the_published_one(tmp_path):
    """transformers 5 holds experts fused ([E, 2F, dim] gate_up_proj, [E, dim, F] down_proj) and a
    Mixtral router at mlp.gate: a checkpoint saved from that state dict loads to the same model."""
    src, fused = tmp_path / "src", tmp_path / "fused"
    make_hf_moe(str(src), "mixtral")
    fused.mkdir()
    state = {k: v.contiguous() for k, v in load_reference(str(src)).state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    state = {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in state.items()}
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    (fused / "config.json").write_text((src / "config.json").read_text())
    a, b = _megaft(str(src)), _megaft(str(fused))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def _hf_config(tmp_path, name: str, **changes) -> str:
    make_hf_moe(str(tmp_path), name)
    file = tmp_path / "config.json"
    raw = json.load(open(file))
    raw.update(changes)
    file.write_text(json.dumps(raw))
    return str(tmp_path)


@pytest.mark.parametrize("name, changes, message", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 is not supported"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0 is not supported"),
    ("qwen2_moe", dict(qkv_bias=False), "qkv_bias=false is not supported"),
    ("qwen3_moe", dict(some_new_router_knob=1), r"fields \['some_new_router_knob'\] are not understood"),
])
def test_config_json_that_would_change_the_math_is_refused(tmp_path, name, changes, message):
    with pytest.raises(HFConfigError, match=message):
        hf_model_config(_hf_config(tmp_path, name, **changes))


def test_model_settings_are_checked_with_their_fix():
    moe = ModelConfig(arch="mixtral", n_experts=4, top_k=2, ffn_dim=96, vocab_size=61)
    assert check_model(moe, 2) == []
    assert any("model.top_k=5 must be between 1 and model.n_experts=4" in p
               for p in check_model(ModelConfig(arch="mixtral", n_experts=4, top_k=5), 1))
    assert any("parallel.tp=2 does not divide model.moe_ffn_dim=51" in p for p in check_model(
        ModelConfig(arch="qwen3_moe", qk_norm=True, n_experts=4, moe_ffn_dim=51, n_heads=2, n_kv_heads=2), 2))
    assert any("fix: model.arch among the mixtures of experts" in p for p in check_model(ModelConfig(n_experts=4), 1))
    assert any("no layer is a mixture of experts" in p for p in check_model(
        ModelConfig(arch="qwen2_moe", qkv_bias=True, n_experts=4, n_layers=2, mlp_only_layers=[0, 1]), 1))
    assert any("parallel.tp=4 exceeds model.n_kv_heads=2 with a full-width qk-norm" in p for p in check_model(
        ModelConfig(arch="olmoe", qk_norm=True, qk_norm_width="full", n_experts=4, n_heads=4, n_kv_heads=2), 4))


def test_router_statistics_skip_sequence_parallel_padding_and_recompute_replays():
    """The log records only while open (a recomputed block's replay in backward adds nothing),
    and `router_losses` pools the layers as transformers does: E * sum_e C_e P_e / (L T)^2."""
    cfg = ModelConfig(arch="mixtral", n_experts=4, top_k=2, vocab_size=61, n_layers=2, dim=32, n_heads=4,
                      ffn_dim=16, router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    torch.manual_seed(0)
    model = Decoder(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, 61, (2, 5))
    model.loss_sum(ids, _labels(ids))
    records = model.router_log.records
    assert [r.layer for r in records] == [0, 1]
    router = model.router_losses()
    assert model.router_log.records == [] and not model.router_log.open
    counts = torch.stack([r.counts for r in records]).sum(0)
    probs = torch.stack([r.probs for r in records]).sum(0)
    rows = 2 * ids.numel()
    assert router.aux.item() == pytest.approx((4 * (counts / rows) * (probs / rows)).sum().item(), rel=1e-6)
    z = torch.stack([r.z for r in records]).sum() / rows
    assert router.local.item() == pytest.approx(0.5 * router.aux.item() + 0.25 * z.item(), rel=1e-6)
    model.router_log.add(records[0])  # closed: ignored
    assert model.router_log.records == []
