"""DeepSeek-V3 (model.arch=deepseek_v3) against transformers' DeepseekV3ForCausalLM on tiny random
checkpoints it saved (tests/models/deepseek_fixture.py): logits, loss (no load-balancing term, as
transformers) and every gradient in one process for both attention variants; group-limited routing
and the correction bias change the choice; the export round-trips; the multi-token-prediction
layers are skipped on load with one message; FP8 checkpoints are read for planning and refused
for training; the bias update rule; and, in one two-rank spawn, tp=2 (with and without sequence
parallel), ep=2 and cp=2 equal the single process."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from multirank import spawn
from safetensors.torch import load_file, save_file

from megaft.config.moe import MoEConfig, check_moe
from megaft.models.attention.documents import Docs
from megaft.models.checks import check_model
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.export import export_hf
from megaft.models.hf.load import HFCheckpointError, load_hf_weights
from megaft.models.moe.balance import correction_biases, update_correction_bias, update_correction_biases
from models.deepseek_fixture import VARIANTS, labels_of, load_reference, make_hf_deepseek, sample_ids
from models.hf_fixture import checkpoint_tensors
from models.moe_fixture import hf_grad_of


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    dirs = {v: str(root / v) for v in VARIANTS}
    for v, path in dirs.items():
        make_hf_deepseek(path, v)
    return dirs


def _megaft(path: str) -> Decoder:
    model = Decoder(hf_model_config(path))
    load_hf_weights(model, path, tp_rank=0, tp_size=1)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_equals_transformers_logits_loss_and_every_gradient(ckpts, variant):
    path = ckpts[variant]
    ref, model = load_reference(path), _megaft(path)
    cfg = model.cfg
    assert (cfg.arch, cfg.mla, cfg.router_scoring, cfg.n_group, cfg.topk_group, cfg.mlp_only_layers) == (
        "deepseek_v3", True, "sigmoid", 4, 2, [0])
    assert cfg.q_lora_rank == VARIANTS[variant]["q_lora_rank"] and cfg.router_aux_loss_coef == 0.0
    ids = sample_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=1e-5)
    labels = labels_of(ids)
    loss = model.loss_sum(ids, labels) / (labels != -100).sum()
    router = model.router_losses()
    out = ref(ids, labels=ids, output_router_logits=True)
    assert out.aux_loss is None and router.local.item() == 0.0  # transformers has no load-balancing loss here
    total = loss + router.local
    assert total.item() == pytest.approx(out.loss.item(), rel=1e-6)
    total.backward()
    out.loss.backward()
    hf_grads = {n: p.grad for n, p in ref.named_parameters()}
    names = [n for n, _ in model.named_parameters()]
    assert any("kv_b_proj" in n for n in names) and any("shared_experts" in n for n in names)
    for name, p in model.named_parameters():
        want = hf_grad_of(hf_grads, name)
        assert (p.grad - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_packed_documents_path_equals_the_plain_one(ckpts):
    """The documents path (values zero-padded to the query width, q carrying the scale's ratio,
    RoPE at per-token positions) gives the plain path's logits on one document per row."""
    model = _megaft(ckpts["plain_q"])
    ids = sample_ids()
    b, s = ids.shape
    docs = Docs(torch.arange(s).expand(b, s), torch.zeros(b, s, dtype=torch.long))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, docs), model(ids), atol=1e-5, rtol=1e-5)


def test_group_limited_routing_and_the_correction_bias_change_the_choice(ckpts):
    model = _megaft(ckpts["latent_q"])
    router = model.layers[1].mlp.gate
    x = torch.randn(256, model.cfg.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, scores, weights, experts = router(x)
        groups = experts // (model.cfg.n_experts // model.cfg.n_group)
        assert all(len(set(g.tolist())) <= model.cfg.topk_group for g in groups)
        # the weights are the unbiased scores, renormalized, times routed_scaling_factor
        torch.testing.assert_close(weights.sum(-1), torch.full((256,), 2.5))
        bias = router.e_score_correction_bias.clone()
        assert bias.abs().min() > 0
        router.e_score_correction_bias.zero_()
        unbiased = router(x)[3]
        router.e_score_correction_bias.copy_(bias)
        router.n_group = 1  # every expert allowed
        ungrouped = router(x)[3]
    chosen = [set(e.tolist()) for e in experts]
    assert sum(c != set(u.tolist()) for c, u in zip(chosen, unbiased)) > 10
    assert sum(c != set(u.tolist()) for c, u in zip(chosen, ungrouped)) > 10


def test_export_round_trips_and_the_prediction_layers_are_skipped(ckpts, tmp_path, caplog):
    """The source gets a multi-token-prediction layer (model.layers.3.*, as DeepSeek-V3 publishes it):
    loaded with one message saying how many tensors were skipped; the export writes transformers'
    names, the correction biases included, and num_nextn_predict_layers 0."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_hf_deepseek(str(src), "latent_q")
    tensors = load_file(str(src / "model.safetensors"))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, str(src / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="megaft.models.hf.load"):
        model = _megaft(str(src))
    skipped = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(skipped) == 1 and f"skipped {len(mtp)} tensors" in skipped[0], skipped
    export_hf(model, model.cfg, str(out), tokenizer_json=str(src), tp_group=None, is_writer=True)
    written = checkpoint_tensors(str(out))
    assert sorted(written) == sorted(tensors)  # per-expert names, mlp.gate.e_score_correction_bias
    assert all(torch.equal(written[k], tensors[k]) for k in tensors)
    config = json.load(open(out / "config.json"))
    assert (config["model_type"], config["num_nextn_predict_layers"], config["n_shared_experts"],
            config["first_k_dense_replace"]) == ("deepseek_v3", 0, 2, 1)
    ids = sample_ids(1)
    with torch.no_grad():
        torch.testing.assert_close(load_reference(str(out))(ids).logits, load_reference(ckpts["latent_q"])(ids).logits,
                                   atol=0, rtol=0)


def test_fp8_checkpoints_are_read_for_planning_and_refused_for_training(ckpts, tmp_path):
    src = ckpts["latent_q"]
    raw = json.load(open(f"{src}/config.json"))
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes(open(f"{src}/model.safetensors", "rb").read())
    cfg = hf_model_config(str(tmp_path))
    assert cfg.arch == "deepseek_v3" and cfg.extra["quantization_config"]["quant_method"] == "fp8"
    assert check_model(dataclasses.replace(cfg, init_from=None), 1) == []  # megaft-plan's view
    assert any("dequantize the checkpoint to bf16 first" in p for p in check_model(cfg, 1))
    with pytest.raises(HFCheckpointError, match="quantized .*fix: dequantize the checkpoint to bf16 first"):
        load_hf_weights(Decoder(dataclasses.replace(cfg, extra={})), str(tmp_path), tp_rank=0, tp_size=1)


def test_bias_update_rule_and_its_setting():
    bias = torch.tensor([0.0, 0.5, -0.5, 0.0])
    update_correction_bias(bias, torch.tensor([10.0, 2.0, 4.0, 4.0]), 0.1)  # mean 5
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.6, -0.4, 0.1]))
    update_correction_bias(bias, torch.tensor([5.0, 5.0, 5.0, 5.0]), 0.1)  # balanced: unchanged
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.6, -0.4, 0.1]))
    assert check_moe(MoEConfig(), n_experts=8, cp=1) == []
    assert any("must be >= 0" in p for p in check_moe(MoEConfig(bias_update_rate=-1.0), n_experts=8, cp=1))
    assert any("have none" in p for p in check_moe(MoEConfig(bias_update_rate=1e-3), n_experts=8, cp=1,
                                                  correction_bias=False))
    assert check_moe(MoEConfig(bias_update_rate=1e-3), n_experts=8, cp=1, correction_bias=True) == []


def test_bias_update_moves_the_model_routers(ckpts):
    model = _megaft(ckpts["latent_q"])
    biases = correction_biases(model)
    buffers = {id(b) for _, b in model.named_buffers()}
    assert sorted(biases) == [1, 2] and all(id(b) in buffers for b in biases.values())
    before = {k: b.clone() for k, b in biases.items()}
    counts = {layer: torch.arange(8.0) for layer in biases}  # expert 7 the busiest
    update_correction_biases(model, counts, 1e-3)
    for layer, b in correction_biases(model).items():
        torch.testing.assert_close(b - before[layer], 1e-3 * torch.sign(3.5 - torch.arange(8.0)))


def test_two_ranks_tp_sequence_parallel_ep_and_cp_equal_the_single_process(ckpts, tmp_path):
    from models.deepseek_cases import two_rank_fn

    spawn(2, two_rank_fn, ckpts, str(tmp_path))


def test_bias_update_in_training_equals_the_single_process_at_dp2_and_pp2(ckpts, tmp_path):
    """moe.bias_update_rate moves each router's correction bias after every step from the global
    batch's loads: at dp=2 (loads summed over replicas and accumulation) and pp=2 (each stage its
    own layers) the losses and the exported biases equal the single process's, and they moved."""
    import json

    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer
    from models.deepseek_cases import BIAS_LAYOUTS, bias_config, bias_update_rank

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i} ", "completion": f"abc{i % 7}"}) + "\n" for i in range(32)))
    ckpt = ckpts["latent_q"]
    (tmp_path / "single").mkdir()
    Trainer(bias_config(ckpt, str(data)), ParallelGrid.single(), str(tmp_path / "single")).fit()
    spawn(2, bias_update_rank, ckpt, str(data), str(tmp_path))

    def run_of(name):
        lines = [json.loads(x) for x in open(tmp_path / name / "metrics.jsonl")]
        biases = {k: v for k, v in checkpoint_tensors(str(tmp_path / name / "hf")).items()
                  if k.endswith("e_score_correction_bias")}
        return [x["loss"] for x in lines if "loss" in x], biases

    want_losses, want_biases = run_of("single")
    start = {k: v for k, v in checkpoint_tensors(ckpt).items() if k.endswith("e_score_correction_bias")}
    assert sorted(want_biases) == sorted(start) and len(start) == 2
    assert all((want_biases[k] - start[k]).abs().max() > 0.04 for k in start)  # they moved (0.05 a step)
    for name in BIAS_LAYOUTS:
        losses, biases = run_of(name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name} losses: {m}")
        for k, b in biases.items():
            torch.testing.assert_close(b, want_biases[k], rtol=0, atol=0, msg=lambda m, k=k: f"{name} {k}: {m}")
