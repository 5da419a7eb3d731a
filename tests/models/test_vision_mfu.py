"""MFU of a vision-language run counts its tower (docs/vision.md): every metrics.jsonl line's mfu
is (text FLOPs of the step's tokens + the tower's FLOPs of the step's images) / (seconds * ranks *
peak), and summary.json's flops_per_token spreads the run's tower FLOPs over its tokens. The
expected numbers are built here from the step's conversations and megaft.perf's per-image counts:
Qwen2.5-VL's images of three sizes, each at its own grid, with a trained tower (3 forwards), and
Gemma 3 under LoRA, whose frozen tower runs forward only (1)."""
from __future__ import annotations

import json
import os

import pytest

from megaft.models.vision.family import vision_config_of
from megaft.parallel.grid import ParallelGrid
from megaft.perf.counts import flops_per_token
from megaft.perf.vision import qwen_vision_forward_flops, vision_forward_flops
from megaft.training.objectives.images import build_data
from megaft.training.protocols import RunParts
from models import qwen_vl_train_cases, vlm_train_cases
from models.vlm_train_cases import STEPS, train, with_lora

PEAK = 1.0  # TFLOP/s: train.peak_tflops makes the CPU run log mfu


def _run(cfg, run_dir: str) -> tuple[list[dict], dict]:
    cfg.train.peak_tflops = PEAK
    train(cfg, ParallelGrid.single(), run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [row for row in map(json.loads, f) if "loss" in row]
    with open(os.path.join(run_dir, "summary.json")) as f:
        return lines, json.load(f)


def _check(cfg, lines: list[dict], summary: dict, tower_flops) -> None:
    """Each step's mfu and the summary's flops_per_token against text + `tower_flops(sample)`."""
    data = build_data(RunParts(cfg, ParallelGrid.single()))
    text = flops_per_token(cfg.model, cfg.data.seq_len, cfg.lora)
    assert len(lines) == STEPS
    all_tokens, all_tower = 0, 0.0
    for step, line in enumerate(lines):
        tokens = data.batch(step).tokens
        tower = sum(tower_flops(s) for s in data.rows(step))
        assert tower > 0.01 * text * tokens  # the tower is a visible part of the step
        want = line["tokens_per_s"] * (text * tokens + tower) / tokens / (PEAK * 1e12)
        assert line["mfu"] == pytest.approx(want, rel=1e-9), step
        all_tokens, all_tower = all_tokens + tokens, all_tower + tower
    assert summary["flops_per_token"] == pytest.approx(text + all_tower / all_tokens, rel=1e-12)


def test_qwen_mfu_counts_each_image_at_its_grid(tmp_path):
    ckpt, data = qwen_vl_train_cases.write_case(str(tmp_path))
    cfg = qwen_vl_train_cases.qwen_config(ckpt, data)
    lines, summary = _run(cfg, str(tmp_path / "run"))
    vision = vision_config_of(ckpt).vision
    samples = build_data(RunParts(cfg, ParallelGrid.single())).samples
    assert len({(h, w) for s in samples for _, h, w in s.grids.tolist()}) > 1  # each counted at its own grid

    def tower(sample) -> float:
        return sum(3 * qwen_vision_forward_flops(vision, h, w) for _, h, w in sample.grids.tolist())
    _check(cfg, lines, summary, tower)


def test_gemma_lora_mfu_counts_the_frozen_tower_forward_only(tmp_path):
    ckpt, data = vlm_train_cases.write_case(str(tmp_path))
    cfg = with_lora(vlm_train_cases.vlm_config(ckpt, data))
    lines, summary = _run(cfg, str(tmp_path / "run"))
    per_image = vision_forward_flops(vision_config_of(ckpt))
    _check(cfg, lines, summary, lambda sample: per_image * len(sample.pixels))
