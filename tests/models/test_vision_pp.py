"""megaft-train on a vision-language model at pp2 (docs/vision.md): the tower and projector on
the first pipeline stage, each micro-batch's images carried beside its ids to every stage
(megaft.models.vision.staged). For a multimodal Gemma 3 (tied embeddings: the last stage holds
the copy) and a Qwen2.5-VL (M-RoPE positions rebuilt on each stage from the images' grids), the
pp2 loss curve equals the single process's (1f1b; 1f1b and interleaved on a file where one
micro-batch has no image; LoRA); a pp2 run stopped and resumed gives the uninterrupted losses bit for bit;
the pp2 export holds every tensor of the single process's, moved as it moved them."""
from __future__ import annotations

import json
import os

import pytest
import torch
from multirank import spawn
from safetensors.torch import load_file

from megaft.parallel.grid import ParallelGrid
from models import qwen_vl_train_cases, vlm_train_cases
from models.vlm_pp_cases import FAMILIES, LAYERS, train_four_ranks, train_pp
from models.vlm_train_cases import STEPS, train, with_lora

pytestmark = pytest.mark.exact

RTOL = 1e-5  # as tests/models/test_vision_train.py: fp32, sums in other orders over 3 AdamW steps
CASES = {"gemma": vlm_train_cases.write_case, "qwen": qwen_vl_train_cases.write_case}


def _losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    family = request.param
    root = str(tmp_path_factory.mktemp(f"vlm_pp_{family}"))
    ckpt, data = CASES[family](root, LAYERS)
    config, mixed = FAMILIES[family], os.path.join(root, "mixed.jsonl")
    train(config(ckpt, data), ParallelGrid.single(), os.path.join(root, "single"))
    train(config(ckpt, mixed, micro=1, batch=2), ParallelGrid.single(), os.path.join(root, "mixed"))
    train(with_lora(config(ckpt, data)), ParallelGrid.single(), os.path.join(root, "lora"))
    spawn(2, train_pp, root, family, ckpt, data)
    return family, root, ckpt


def test_pp2_gives_the_single_process_loss_curve(case):
    family, root, _ = case
    for name, single in [("pp2", "single"), ("mixed_pp2", "mixed"), ("mixed_interleaved", "mixed"),
                         ("lora_pp2", "lora")]:
        want, got = _losses(os.path.join(root, single)), _losses(os.path.join(root, f"{family}_{name}"))
        assert len(got) == len(want) == STEPS, name
        for step, (g, w) in enumerate(zip(got, want), start=1):
            assert g == pytest.approx(w, rel=RTOL), f"{family} {name} step {step}: {g} vs {w}"
        assert got[-1] < got[0], name  # it trains
    # the stages hold the model once: the tower on the first stage only, the tied copy not counted again
    with open(os.path.join(root, "single", "summary.json")) as f, \
            open(os.path.join(root, f"{family}_pp2", "summary.json")) as g:
        one, staged = json.load(f), json.load(g)
    assert staged["params"] == one["params"] and staged["trainable_params"] == one["trainable_params"]
    # stopped after 2 steps and resumed: the uninterrupted run's losses (same ops, same order)
    assert _losses(os.path.join(root, f"{family}_resumed_pp2")) == _losses(os.path.join(root, f"{family}_mixed_pp2"))


def test_pp2_export_holds_every_tensor_moved_as_the_single_process_moved_it(case):
    family, root, ckpt = case
    single = load_file(os.path.join(root, "single", "hf", "model.safetensors"))
    staged = load_file(os.path.join(root, f"{family}_pp2", "hf", "model.safetensors"))
    base = load_file(os.path.join(ckpt, "model.safetensors"))
    assert staged.keys() == single.keys()
    tower = "visual." if family == "qwen" else "vision_tower."
    assert any(n.startswith(tower) for n in staged) and any(f"layers.{LAYERS - 1}." in n for n in staged)
    for name, want in single.items():
        got = staged[name]
        assert got.shape == want.shape, name
        src = base.get(name, base.get(name.replace("vision_tower.vision_model.", "vision_tower."), None))
        moved = (want - src).abs().max() if src is not None else want.abs().max()
        # pp moved it as one process did (1e-5: a tensor with a near-zero gradient, SigLIP's key bias, moves
        # by AdamW's ratio of two rounding-sized numbers, ~1e-6 here, in any layout)
        assert (got - want).abs().max() <= 1e-2 * moved + 1e-5, name
    with open(os.path.join(root, f"{family}_pp2", "hf", "config.json")) as f:
        with open(os.path.join(root, "single", "hf", "config.json")) as g:
            assert json.load(f) == json.load(g)


def test_lora_pp2_adapter_equals_the_single_process_adapter(case):
    family, root, _ = case
    single = load_file(os.path.join(root, "lora", "hf", "adapter_model.safetensors"))
    staged = load_file(os.path.join(root, f"{family}_lora_pp2", "hf", "adapter_model.safetensors"))
    assert staged.keys() == single.keys() and any(f".layers.{LAYERS - 1}." in n for n in staged)
    for name, want in single.items():
        assert torch.allclose(staged[name], want, rtol=1e-3, atol=1e-5), name


def test_four_ranks_give_the_single_process_loss_curve(case):
    """tp2 x pp2 with sequence parallel (the first stage writes each tp rank's shard of the features),
    and ZeRO-3 under pp (pp2 x dp2), one dp rank's row without an image: Qwen2.5-VL's loss curve is
    the single process's. Gemma 3 ties its embeddings, so ZeRO-3 with pp is refused for it as for a
    tied text model (the copies' grads are summed before the dp reduction)."""
    from megaft.validation import validate

    family, root, ckpt = case
    spawn(4, train_four_ranks, root, family, ckpt, os.path.join(root, "chat.jsonl"))
    runs = [("tp2_pp2_sp", "single")]
    if family == "gemma":
        cfg = FAMILIES[family](ckpt, os.path.join(root, "mixed.jsonl"), micro=1, batch=2)
        cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = 2, 2, 3
        assert any("parallel.zero=3 with parallel.pp>1 and model.tie_embeddings" in p for p in validate(cfg, 4))
    else:
        runs.append(("mixed_pp2_dp2_zero3", "mixed"))
    for name, single in runs:
        want, got = _losses(os.path.join(root, single)), _losses(os.path.join(root, f"{family}_{name}"))
        assert len(got) == len(want) == STEPS, name
        for step, (g, w) in enumerate(zip(got, want), start=1):
            assert g == pytest.approx(w, rel=RTOL), f"{family} {name} step {step}: {g} vs {w}"


def test_megaft_verify_passes_at_pp2(case, tmp_path):
    """megaft-verify's run (megaft.verify.run.run_verify) at pp2 on the file where one micro-batch has no
    image: every step's loss and grad norm and every parameter's step-1 gradient, from both stages and
    the tower's included, equal the single process's."""
    from megaft.verify.run import run_verify

    family, root, ckpt = case
    cfg = FAMILIES[family](ckpt, os.path.join(root, "mixed.jsonl"), 2, micro=1, batch=2, pp=2)
    cfg.launcher.nproc, cfg.verify.steps = 2, STEPS
    report = run_verify(cfg, str(tmp_path))
    assert report.passed, report.format()
    assert all(r.loss_rel <= RTOL and r.grad_norm_rel <= 1e-4 for r in report.rows), report.format()
    names = {name for name, _ in report.grads}
    tower = "visual." if family == "qwen" else "vision_tower."
    assert any(n.startswith(tower) for n in names) and any(f"layers.{LAYERS - 1}." in n for n in names)
