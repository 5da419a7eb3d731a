"""A tiny Qwen2.5-VL checkpoint beside the Qwen processor fixture, an image chat file and the
megaft-train config that trains one on the other, for tests/models/test_qwen_vl_train.py (the
rank function for the layouts lives here so that multirank's workers import it by name)."""
from __future__ import annotations

import json
import os

import torch
import transformers
from data.image_fixture import write_images
from data.qwen_image_fixture import MERGE, PATCH, TEMPORAL, make_qwen_processor

from megaft.config import Config
from megaft.validation import validate
from models.vlm_train_cases import (  # noqa: F401  (LAYOUTS: the tests name the same runs)
    LAYOUTS,
    QUESTIONS,
    train_family_layouts,
    vlm_config,
    write_mixed,
)

SEQ_LEN = 128  # the character tokenizer spells Qwen's default system prompt: ~100 tokens with an image
TOO_LONG = 2  # conversations whose answer pushes them past SEQ_LEN


@torch.no_grad()
def make_processor_qwen_vl(path: str, layers: int = 2) -> None:
    """The processor fixture's tokenizer and template beside a random tiny Qwen2.5-VL of its
    vocabulary and patch sizes, `layers` text layers (weights std 0.1, norms near 1: every tensor
    moves the loss)."""
    tok = make_qwen_processor(path).tokenizer
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=16, fullatt_block_indexes=[1])
    torch.manual_seed(1)
    model = transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)).float()
    for name, p in model.named_parameters():
        norm = name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight"))
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if norm else 0.0))
    model.save_pretrained(path)


def write_case(root: str, layers: int = 2) -> tuple[str, str]:
    """(checkpoint dir, data file) under `root`: the checkpoint (`layers` text layers), and
    len(QUESTIONS) conversations with one or two images of different sizes, plus TOO_LONG too long
    for SEQ_LEN."""
    ckpt = os.path.join(root, "ckpt")
    make_processor_qwen_vl(ckpt, layers)
    names = list(write_images(os.path.join(root, "img")).values())
    lines = []
    for i, (q, a) in enumerate(QUESTIONS):
        images = [{"type": "image", "image": f"img/{names[(i + k) % len(names)]}"} for k in range(1 + i % 2)]
        lines.append({"messages": [{"role": "user", "content": [*images, {"type": "text", "text": q}]},
                                   {"role": "assistant", "content": a}]})
    for i in range(TOO_LONG):
        lines.insert(2 * i + 1, {"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"img/{names[i]}"},
                                         {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": "A long answer. " * 4}]})
    path = os.path.join(root, "chat.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    write_mixed(root, names)
    return ckpt, path


def qwen_config(ckpt: str, data: str, world: int = 1, **parallel) -> Config:
    """vlm_config's run (3 steps of 4 conversations in micro-batches of 2) at SEQ_LEN."""
    cfg = vlm_config(ckpt, data, world, **parallel)
    cfg.data.seq_len = SEQ_LEN
    problems = validate(cfg, world)
    assert not problems, problems
    return cfg


def train_layouts(rank: int, world: int, root: str, ckpt: str, data: str) -> None:
    """Qwen2.5-VL's runs of models.vlm_train_cases.train_family_layouts on this rank."""
    train_family_layouts(qwen_config, world, root, ckpt, data)
