"""megaft-train on a multimodal Gemma 3 (docs/vision.md): the Trainer, as megaft-train runs it,
on a tiny random checkpoint saved by transformers and an image chat file. The first step's
loss is Gemma3ForConditionalGeneration's on the same batch; tp2, tp2 with sequence parallel
and dp2 ZeRO-1, -2 and -3 give the single process's loss curve (also when one dp rank's
micro-batch has no image, ZeRO-3 also stopped and resumed, and megaft-verify passes on it);
too-long conversations are dropped and counted in summary.json; a frozen tower keeps its
weights; the export loads in transformers."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from multirank import spawn
from safetensors.torch import load_file

from megaft.parallel.grid import ParallelGrid
from megaft.training.objectives.images import build_data
from megaft.training.protocols import RunParts
from models.vlm_train_cases import (
    LAYOUTS,
    STEPS,
    TOO_LONG,
    train,
    train_layouts,
    vlm_config,
    with_lora,
    write_case,
)

pytestmark = pytest.mark.exact

# fp32 on both sides, sums in other orders (tp splits, dp reductions, micro-batches): ~1e-7
# relative per op, compounded over 3 AdamW steps; 1e-5 relative is the training tests' bound.
RTOL = 1e-5


def _losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vlm_train"))
    ckpt, data = write_case(root)
    train(vlm_config(ckpt, data), ParallelGrid.single(), os.path.join(root, "single"))
    train(vlm_config(ckpt, os.path.join(root, "mixed.jsonl"), micro=1, batch=2), ParallelGrid.single(),
          os.path.join(root, "mixed"))
    train(with_lora(vlm_config(ckpt, data)), ParallelGrid.single(), os.path.join(root, "lora"))
    return root, ckpt, data


def test_first_step_loss_equals_transformers(case):
    root, ckpt, data = case
    cfg = vlm_config(ckpt, data)
    batch = build_data(RunParts(cfg, ParallelGrid.single())).batch(0)
    ids, labels = torch.cat(batch.inputs), torch.cat(batch.labels)
    pixels = torch.cat(batch.pixels)
    assert len(pixels) > len(ids)  # a row with two images: the order of images across rows matters
    # transformers shifts its labels itself: megaft's next-token labels one place to the right
    hf_labels = torch.cat([torch.full((len(ids), 1), -100), labels[:, :-1]], dim=1)
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                                            attn_implementation="eager").train()
    image_id = reference.config.image_token_index
    with torch.no_grad():
        want = reference(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == image_id).long(),
                         labels=hf_labels).loss.item()
    got = _losses(os.path.join(root, "single"))
    assert len(got) == STEPS
    assert got[0] == pytest.approx(want, rel=RTOL)
    assert got[-1] < got[0]  # it trains


def test_too_long_conversations_are_dropped_and_counted(case):
    root, _, _ = case
    with open(os.path.join(root, "single", "summary.json")) as f:
        summary = json.load(f)
    assert summary["dropped_long"] == TOO_LONG


def test_export_loads_in_transformers_with_the_trained_weights(case):
    root, ckpt, _ = case
    hf = os.path.join(root, "single", "hf")
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(hf, dtype=torch.float32)
    start = transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    trained, base = dict(model.named_parameters()), dict(start.named_parameters())
    assert trained.keys() == base.keys()
    moved = [n for n in trained if not torch.equal(trained[n], base[n])]
    assert any("vision_tower" in n for n in moved) and any("language_model" in n for n in moved)
    assert os.path.isfile(os.path.join(hf, "preprocessor_config.json")) or \
        os.path.isfile(os.path.join(hf, "processor_config.json"))


def test_frozen_tower_and_projector_keep_their_weights(case, tmp_path):
    root, ckpt, data = case
    cfg = vlm_config(ckpt, data)
    cfg.model.freeze = ["vision", "projector"]
    summary = train(cfg, ParallelGrid.single(), str(tmp_path))
    before = load_file(os.path.join(ckpt, "model.safetensors"))
    after = load_file(os.path.join(tmp_path, "hf", "model.safetensors"))
    frozen = [n for n in after if "vision_tower" in n or "multi_modal_projector" in n]
    assert frozen
    for name in frozen:
        # transformers 5 saves vision_tower.*; the export writes the published vision_tower.vision_model.*
        src = name.replace("vision_tower.vision_model.", "vision_tower.") if name not in before else name
        assert torch.equal(after[name], before[src]), name
    assert any(not torch.equal(after[n], before[n]) for n in after if "language_model" in n and n in before)
    tower = sum(v.numel() for n, v in after.items() if n in frozen)
    assert summary["params"] - summary["trainable_params"] == tower  # no optimizer state for them


def test_layouts_give_the_single_process_loss_curve(case):
    root, ckpt, data = case
    spawn(2, train_layouts, root, ckpt, data)
    for name, single in [*((n, "single") for n in LAYOUTS), ("mixed_dp2", "mixed"),
                         ("mixed_dp2_zero3", "mixed"), ("lora_tp2", "lora")]:
        want, got = _losses(os.path.join(root, single)), _losses(os.path.join(root, name))
        assert len(got) == len(want) == STEPS, name
        for step, (g, w) in enumerate(zip(got, want), start=1):
            assert g == pytest.approx(w, rel=RTOL), f"{name} step {step}: {g} vs {w}"
    # dp2 ZeRO-3 stopped after 2 steps and resumed: the uninterrupted run's losses (same ops, same order)
    assert _losses(os.path.join(root, "resumed_dp2_zero3")) == _losses(os.path.join(root, "mixed_dp2_zero3"))


def test_resumed_run_continues_the_loss_curve(case, tmp_path):
    """Stopped after 2 steps with a checkpoint, then run again: the 3 losses are the uninterrupted run's
    (the parameters and AdamW state come back, and the batches are a function of the step)."""
    from megaft.training.loop import Trainer

    root, ckpt, data = case
    for stop_after in (2, None):
        cfg = vlm_config(ckpt, data)
        cfg.train.save_every = 1
        Trainer(cfg, ParallelGrid.single(), str(tmp_path)).fit(stop_after=stop_after)
        if stop_after:
            assert len(_losses(str(tmp_path))) == 2
    assert _losses(str(tmp_path)) == _losses(os.path.join(root, "single"))  # same ops in the same order


def test_validation_names_the_line_of_a_missing_image(case, tmp_path):
    from megaft.validation import validate

    _, ckpt, data = case
    with open(data) as f:
        lines = f.readlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + lines[1].replace("img/", "missing/"))
    cfg = vlm_config(ckpt, data)
    cfg.data.path = str(bad)
    problems = validate(cfg, 1)
    assert any(f"{bad}:2: image" in p and "is not a file" in p for p in problems), problems


def test_lora_run_trains_adapters_that_peft_loads(case):
    """LoRA through megaft-train: the first loss is the base model's (B starts at 0), only the
    adapters train, and RUN_DIR/hf is a peft adapter of Gemma3ForConditionalGeneration that
    changes transformers' logits."""
    import peft

    root, ckpt, data = case
    run = os.path.join(root, "lora")
    got, base = _losses(run), _losses(os.path.join(root, "single"))
    assert got[0] == pytest.approx(base[0], rel=RTOL) and got[-1] < got[0]
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    assert 0 < summary["trainable_params"] < summary["params"] / 10
    cfg = vlm_config(ckpt, data)
    batch = build_data(RunParts(cfg, ParallelGrid.single())).batch(0)
    ids, pixels = batch.inputs[0], batch.pixels[0]
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    image_id = model.config.image_token_index
    with torch.no_grad():
        before = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == image_id).long()).logits
        tuned = peft.PeftModel.from_pretrained(model, os.path.join(run, "hf")).eval()
        after = tuned(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == image_id).long()).logits
    assert (after - before).abs().max() > 1e-3 * before.abs().max()


def test_megaft_verify_passes_on_dp2_zero3_with_a_rank_without_images(case, tmp_path):
    """megaft-verify's run (megaft.verify.run.run_verify) on an image chat config at dp2 ZeRO-3, one
    rank's row without an image: every step's loss and grad norm and every parameter's step-1
    gradient, the tower's and projector's included, equal the single process's; verify.shrink=auto,
    which would verify a random text model, is refused with its fix."""
    from megaft.config import ConfigError
    from megaft.verify.run import run_verify

    root, ckpt, _ = case
    cfg = vlm_config(ckpt, os.path.join(root, "mixed.jsonl"), 2, micro=1, batch=2, dp=2, zero=3)
    cfg.launcher.nproc, cfg.verify.steps = 2, STEPS
    report = run_verify(cfg, str(tmp_path))
    assert report.passed, report.format()
    assert [r.step for r in report.rows] == list(range(1, STEPS + 1))
    assert all(r.loss_rel <= RTOL and r.grad_norm_rel <= 1e-4 for r in report.rows), report.format()
    names = {name for name, _ in report.grads}
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("multi_modal_projector.")
                                                                     for n in names)
    assert report.grads[0][1] <= 1e-4
    cfg.verify.shrink = "auto"
    with pytest.raises(ConfigError, match="verify.shrink=auto with images.*fix: verify.shrink=none"):
        run_verify(cfg, str(tmp_path))
