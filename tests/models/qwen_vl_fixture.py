"""A tiny random Qwen2_5_VLForConditionalGeneration saved by transformers, and a batch with
images of three grid shapes, for tests/models/test_qwen_vl.py."""
from __future__ import annotations

import torch
import transformers

from models.hf_fixture import VOCAB, write_char_tokenizer

VSTART, VEND, IMAGE, VIDEO = VOCAB, VOCAB + 1, VOCAB + 2, VOCAB + 3  # past the character vocabulary
PATCH, MERGE, TEMPORAL = 4, 2, 2
# (t, h, w) in patches: merged grids 2x3, 3x2 and 2x2; windows of 2x2 merged tokens (window_size 16 px)
# cut the first two at their edge, and the third is one whole window
GRIDS = [(1, 4, 6), (1, 6, 4), (1, 4, 4)]
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH


def hf_qwen_config() -> transformers.Qwen2_5_VLConfig:
    text = dict(vocab_size=VOCAB + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=16, fullatt_block_indexes=[1])
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                         video_token_id=VIDEO, vision_start_token_id=VSTART,
                                         vision_end_token_id=VEND, attn_implementation="eager")


@torch.no_grad()
def make_hf_qwen_vl(path: str, *, seed: int = 0) -> transformers.Qwen2_5_VLForConditionalGeneration:
    """Save a random tiny Qwen2_5_VLForConditionalGeneration (+ tokenizer.json) into `path`;
    weights redrawn with std 0.1 (norm weights near 1) so that every tensor moves the logits."""
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(hf_qwen_config()).float()
    for name, p in model.named_parameters():
        norm = name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight"))
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if norm else 0.0))
    model.save_pretrained(path)
    write_char_tokenizer(path)
    return model.eval()


def tokens(grid: tuple) -> int:
    t, h, w = grid
    return t * (h // MERGE) * (w // MERGE)


def qwen_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [2, seq], labels (next tokens, -100 after a row's end), pixel_values
    [patches, PATCH_DIM], image_grid_thw [3, 3]): row 0 holds two images (one near the start),
    row 1 one image mid-row, then right padding."""
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    def image(grid):
        return [VSTART] + [IMAGE] * tokens(grid) + [VEND]

    rows = [[2] + image(GRIDS[0]) + text(3) + image(GRIDS[1]) + text(4), [2] + text(5) + image(GRIDS[2]) + text(3)]
    seq = max(map(len, rows))
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, :len(row) - 1] = ids[i, 1:len(row)]
    patches = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.rand(patches, PATCH_DIM, generator=gen) * 4 - 2  # the processor's normalized range
    return ids, labels, pixels, torch.tensor(GRIDS)
