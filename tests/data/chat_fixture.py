"""Tiny chat checkpoints for the data tests: a byte-level BPE tokenizer.json trained
with the `tokenizers` library, with the chat special tokens as added tokens, and a
tokenizer_config.json holding the template and special tokens, as HF checkpoints have."""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ["You are a helpful assistant. What is two plus two? It is four.",
          "The capital of France is Paris. système héllo naïve café",
          "user assistant system Qwen Alibaba Cloud tools function"]

# Meta's Llama 3 template (no generation markers).
LLAMA3_META = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# ChatML without markers (what most checkpoints ship).
CHATML_PLAIN = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Qwen2.5's template, tools branch included ({%- -%} whitespace control, tojson, loop.first).
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- generation %}
        {{- message.content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN_PLAIN = QWEN.replace("        {%- generation %}\n", "").replace("        {%- endgeneration %}\n", "")

# Exercises the environment: loopcontrols, namespace, tojson without HTML escaping,
# strftime_now, raise_exception (for a "tool" role it never sees here).
FEATURES = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ raise_exception('no tools') }}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}<{{ m.role }}>{{ m | tojson }}{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% endif %}\n{% endfor %}"
    "n={{ ns.n }} year={{ strftime_now('%Y') }} bos={{ bos_token }}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is four."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "The capital of France?"}, {"role": "assistant", "content": " Paris \n"},
     {"role": "user", "content": "héllo <b>&café</b> 🙂"}, {"role": "assistant", "content": "naïve système"}],
    [{"role": "user", "content": "two"}, {"role": "assistant", "content": "four"},
     {"role": "user", "content": "France"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "last"}],
]


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """A ~400-token byte-level BPE, trained once per session (milliseconds)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok.to_str()


def make_checkpoint(path: str, chat_template: Optional[object] = None, **config) -> str:
    """A directory with tokenizer.json and tokenizer_config.json (+ `config` entries)."""
    os.makedirs(path, exist_ok=True)
    Tokenizer.from_str(tokenizer_json()).save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
           "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                         "rstrip": False, "single_word": False, "special": True},
           "pad_token": "<|endoftext|>", **config}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
