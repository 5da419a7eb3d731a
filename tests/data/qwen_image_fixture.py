"""A tiny Qwen2.5-VL processor saved by transformers (a character tokenizer with Qwen's special
tokens, Qwen2-VL's published chat template, the Pillow image processor with 4-pixel patches)
beside a config.json of the same vision sizes, for tests/data/test_qwen_image_chat.py.
write_images' four images (30x41, 17x23, 50x20, 33x33) take smart_resize's three branches at
these bounds: shrunk to max_pixels, grown to min_pixels, rounded."""
from __future__ import annotations

import json
import os

import transformers
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<unk>")
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!:\n"
PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 500, 1100
# Qwen2-VL / Qwen2.5-VL's chat template as Qwen/Qwen2.5-VL-*-Instruct publish it
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


class ImageOnlyProcessor(transformers.Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor without its video processor (which needs torchvision, not installed
    here); images and text go through the inherited code unchanged."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        transformers.ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def make_qwen_processor(path: str) -> ImageOnlyProcessor:
    """Save a Qwen2_5_VLProcessor (and a config.json with its vision sizes) into `path`."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>")
    images = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=PATCH, merge_size=MERGE,
        temporal_patch_size=TEMPORAL)
    processor = ImageOnlyProcessor(image_processor=images, tokenizer=fast, chat_template=QWEN2_VL_TEMPLATE)
    processor.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2_5_vl", "vision_config": {
            "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL}}, f)
    return processor
