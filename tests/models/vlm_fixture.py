"""A tiny random Gemma3ForConditionalGeneration saved by transformers, and batches with
images for the vision-language tests (tests/models/test_vision.py); `make_processor_gemma3`: a model
beside the processor fixture (a real tokenizer, chat template and image processor)."""
from __future__ import annotations

import torch
import transformers
from data.image_fixture import SIZE, TOKENS_PER_IMAGE, make_processor

from models.hf_fixture import VOCAB, write_char_tokenizer

BOI, EOI, IMAGE = VOCAB, VOCAB + 1, VOCAB + 2  # the image tokens past the character vocabulary
MM_TOKENS = 4  # 16 patches (28 px / 7) pooled 2x2 into 4 tokens per image
WINDOW = 3  # shorter than an image's 4 tokens: the local layers' window cuts into an image's bidirectional block


def hf_gemma3_config() -> transformers.Gemma3Config:
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB + 3, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=64,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
        bos_token_id=2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=28, patch_size=7,
                                             vision_use_head=False)
    return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                     mm_tokens_per_image=MM_TOKENS, image_token_index=IMAGE, boi_token_index=BOI,
                                     eoi_token_index=EOI, attn_implementation="eager")


@torch.no_grad()
def make_hf_gemma3(path: str, *, seed: int = 0) -> transformers.Gemma3ForConditionalGeneration:
    """Save a random tiny Gemma3ForConditionalGeneration (+ tokenizer.json) into `path`.
    Weights are redrawn with std 0.1 (norm weights near 0: Gemma's (1 + w)), so every tensor
    moves the logits; the projection gets std 0.3 so that image features matter."""
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(hf_gemma3_config()).float()
    for name, p in model.named_parameters():
        scale = 0.3 if "mm_input_projection" in name else 0.1
        p.copy_(torch.randn_like(p) * scale + (1.0 if name.endswith(("layer_norm1.weight", "layer_norm2.weight",
                                                                      "post_layernorm.weight")) else 0.0))
    model.save_pretrained(path)
    write_char_tokenizer(path)
    return model.eval()


def image_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [2, 20], labels (next tokens, -100 after a row's end), pixel_values [3, 3, 28, 28]):
    row 0 holds two images (one at the start), row 1 one image mid-row, then right padding."""
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    image = [BOI] + [IMAGE] * MM_TOKENS + [EOI]
    rows = [[2] + image + text(3) + image + text(4), [2] + text(5) + image + text(3)]
    seq = max(map(len, rows))
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, :len(row) - 1] = ids[i, 1:len(row)]
    pixels = torch.rand(3, 3, 28, 28, generator=gen) * 2 - 1  # the processor's [-1, 1] range
    return ids, labels, pixels


@torch.no_grad()
def make_processor_gemma3(path: str, layers: int = 2) -> transformers.Gemma3Processor:
    """The processor fixture's tokenizer and template beside a random tiny model of its vocabulary
    (`layers`: an even number of text layers, sliding and full in turn)."""
    processor = make_processor(path)
    tok = processor.tokenizer
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=128, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2), pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=SIZE, patch_size=7,
                                             vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=tok.image_token_id,
                                    boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id)
    torch.manual_seed(1)
    model = transformers.Gemma3ForConditionalGeneration(cfg).float()
    for name, p in model.named_parameters():  # every tensor moves the loss (as make_hf_gemma3)
        p.copy_(torch.randn_like(p) * (0.3 if "mm_input_projection" in name else 0.1)
                + (1.0 if name.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight"))
                   else 0.0))
    model.save_pretrained(path)
    return processor
