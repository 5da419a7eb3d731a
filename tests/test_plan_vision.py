"""megaft-plan on a vision-language checkpoint (docs/vision.md): Qwen2.5-VL-7B-Instruct's config.json
(transcribed in tests/models/test_qwen_vl.py) and Gemma 3 4B's (tests/models/real_configs) plan their
language model, and plan.json's "vision" block holds the tower's parameters (the module's, built on
the meta device), its training FLOPs per image at plan.image_size and per step at
plan.images_per_sample, their share of the step's model FLOPs, and the activations it saves. Every
layout counts the tower on its first pipeline stage: its weights, gradients and AdamW state as ZeRO
shards them (a frozen tower: its weights alone), its images' activations, and a `vision` term of
step time; the text model's best layout no longer fits once the tower's images are counted."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir
from models.test_qwen_vl import QWEN25_VL_7B_TEXT
from omegaconf import OmegaConf

from megaft.config import conf_dir
from megaft.models.vision.family import vision_config_of
from megaft.perf.counts import flops_per_token, total_params
from megaft.perf.hardware import GIB
from megaft.perf.memory import estimate_ranks
from megaft.perf.rates import compute_rates
from megaft.perf.vision import qwen_tower_activation_elements, qwen_vision_forward_flops, vision_forward_flops
from megaft.plan.app import run_plan
from megaft.plan.shape import planning_config
from megaft.plan.space import Layout, apply_layout, search

REAL = os.path.join(os.path.dirname(__file__), "models", "real_configs")
VISION_7B = {"depth": 32, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "hidden_size": 1280,
             "in_chans": 3, "intermediate_size": 3420, "model_type": "qwen2_5_vl", "num_heads": 16,
             "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
             "temporal_patch_size": 2, "tokens_per_second": 2, "window_size": 112}


def _plan(tmp_path, ckpt: str, *extra: str) -> tuple[int, dict, str]:
    args = [f"model.init_from={ckpt}", "cluster=h100", "cluster.nodes=1", "data.seq_len=4096",
            "model.max_seq_len=4096", "train.global_batch_size=64", "precision=bf16", "data.packing=none",
            f"data.path={tmp_path / 'chat.jsonl'}", *extra]
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("megaft_plan", overrides=args))
    status, out = run_plan(cfg, str(tmp_path / "run"), args)
    with open(tmp_path / "run" / "plan.json") as f:
        assert json.load(f)["vision"] == out["vision"]
    return status, out, cfg


def _text_estimate(cfg, top: dict):
    """pp rank 0's estimate of plan.json layout `top` for the language model alone (world 8)."""
    shaped, problems = planning_config(cfg)
    assert not problems
    layout = Layout(**{k: top[k] for k in Layout.__dataclass_fields__})
    return shaped, layout, estimate_ranks(apply_layout(shaped, layout), 8)[0]


def test_plans_qwen2_5_vl_7b_with_its_tower(tmp_path, capsys):
    from megaft.models.vision.qwen_tower import QwenVisionTower

    ckpt = tmp_path / "qwen2.5-vl-7b"
    ckpt.mkdir()
    raw = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], **QWEN25_VL_7B_TEXT, "image_token_id": 151655,
           "model_type": "qwen2_5_vl", "tie_word_embeddings": False, "vision_start_token_id": 151652,
           "vision_end_token_id": 151653, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
           "vision_config": VISION_7B}
    (ckpt / "config.json").write_text(json.dumps(raw))
    # 500 x 510 px: the processor rounds each side to a multiple of 28, 504 x 504 (36 x 36 patches)
    status, out, cfg = _plan(tmp_path, str(ckpt), "plan.images_per_sample=2", "plan.image_size=[500,510]")
    assert status == 0 and out["layouts"]
    vlm = vision_config_of(str(ckpt))
    assert out["model"]["params"] == total_params(vlm.text) and out["model"]["n_layers"] == 28  # the language model
    v, block = vlm.vision, out["vision"]
    with torch.device("meta"):
        assert block["params"] == sum(p.numel() for p in QwenVisionTower(v).parameters())
    assert block["image_pixels"] == [504, 504] and block["patches"] == [36, 36] and block["tokens_per_image"] == 324
    per_image = 3 * qwen_vision_forward_flops(v, 36, 36)  # the tower trains: forward and backward
    assert block["trains"] and block["train_flops_per_image"] == per_image
    assert block["step_flops"] == 2 * 64 * per_image
    text = flops_per_token(vlm.text, 4096) * 4096 * 64
    assert block["share_of_step_flops"] == pytest.approx(block["step_flops"] / (block["step_flops"] + text))
    assert block["activation_bytes_per_image"] == 2 * qwen_tower_activation_elements(v, 36, 36)  # bf16
    assert block["activation_bytes_per_sample"] == 2 * block["activation_bytes_per_image"]
    printed = capsys.readouterr().out
    assert f"megaft-plan: vision tower (qwen2_5_vl): {block['params'] / 1e6:.1f}M params, 2 image(s) of 504x504 px" \
        in printed
    # the best layout (pp=1: rank 0 is its fullest) holds the tower beside the language model
    top = out["layouts"][0]
    shaped, layout, text = _text_estimate(cfg, top)
    assert top["pp"] == 1 and top["zero"] in (1, 2)  # fp32 weights and grads, 8 bytes of AdamW state per param
    grads_shard = top["dp"] if top["zero"] >= 2 else 1
    parts, p = top["memory_parts_gib"], block["params"]
    assert parts["params"] == pytest.approx((text.params + 4 * p) / GIB)
    assert parts["grads"] == pytest.approx((text.grads + 4 * p // grads_shard) / GIB)
    assert parts["optimizer"] == pytest.approx((text.optimizer + 8 * p // top["dp"]) / GIB)
    images = top["micro_batch_size"] * block["activation_bytes_per_sample"]  # one micro-batch in flight
    assert parts["activations"] == pytest.approx((text.activations + images) / GIB)
    rate = compute_rates(shaped.cluster, "bf16").rate
    assert top["terms_s"]["vision"] == pytest.approx(block["step_flops"] / top["dp"] / rate)
    # the language model's best layout alone does not fit with the tower's images
    alone = search(shaped, shaped.cluster, cfg.plan).ranked[0].layout
    assert alone != layout and all(Layout(**{k: row[k] for k in Layout.__dataclass_fields__}) != alone
                                   for row in out["layouts"])


def test_plans_gemma3_with_a_frozen_tower_forward_only(tmp_path):
    ckpt = tmp_path / "gemma-3-4b-it"
    ckpt.mkdir()
    shutil.copy(os.path.join(REAL, "gemma-3-4b-it.json"), ckpt / "config.json")
    status, out, cfg = _plan(tmp_path, str(ckpt), "model.freeze=[vision,projector]")
    vlm = vision_config_of(str(ckpt))
    block = out["vision"]
    top = out["layouts"][0]
    _, _, text = _text_estimate(cfg, top)
    assert top["pp"] == 1
    parts = top["memory_parts_gib"]  # frozen: its fp32 weights whole, no grads, state or saved activations
    assert parts["params"] == pytest.approx((text.params + 4 * block["params"]) / GIB)
    assert (parts["grads"], parts["activations"]) == pytest.approx((text.grads / GIB, text.activations / GIB))
    assert status == 0 and not block["trains"]
    assert block["train_flops_per_image"] == vision_forward_flops(vlm)  # frozen: one forward, no backward
    assert block["image_pixels"] == [896, 896] and block["tokens_per_image"] == vlm.mm_tokens_per_image == 256
    assert out["model"]["n_layers"] == vlm.text.n_layers
