"""A tiny Gemma 3 processor saved by transformers (tokenizer with the image tokens, Gemma 3's
chat template, a 28-pixel Pillow image processor) and images of several modes, for
tests/data/test_image_chat.py."""
from __future__ import annotations

import json
import os

import numpy as np
import transformers
from PIL import Image
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>")
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!\n"
TOKENS_PER_IMAGE = 4
SIZE = 28
# Gemma 3's chat template as google/gemma-3-*-it publish it (system folded into the first user
# turn, assistant -> model, an image part -> <start_of_image>)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n")


def make_processor(path: str) -> transformers.Gemma3Processor:
    """Save a Gemma3Processor (and a config.json with mm_tokens_per_image) into `path`."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(path, "tokenizer.json"), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                 "image_token": "<image_soft_token>"})
    images = transformers.Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE}, image_mean=[0.5] * 3,
                                                  image_std=[0.5] * 3, resample=2, rescale_factor=1 / 255)
    processor = transformers.Gemma3Processor(image_processor=images, tokenizer=fast, chat_template=GEMMA3_TEMPLATE,
                                             image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "gemma3", "mm_tokens_per_image": TOKENS_PER_IMAGE}, f)
    return processor


def write_images(folder: str) -> dict[str, str]:
    """Random images of each Pillow mode the processor converts (not square, not 28 px), by name."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for mode, shape in (("RGB", (30, 41, 3)), ("RGBA", (17, 23, 4)), ("L", (50, 20)), ("P", (33, 33))):
        data = rng.integers(0, 256, shape, dtype=np.uint8)
        image = Image.fromarray(data, "L" if mode == "P" else mode)
        if mode == "P":
            image = image.convert("P")
        name = f"{mode.lower()}.png"
        image.save(os.path.join(folder, name))
        out[mode] = name
    return out
