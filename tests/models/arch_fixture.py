"""Tiny random checkpoints of every supported family, saved with transformers itself.

Each variant is a transformers config (fp32, eager attention) chosen so that its
family's differences move the logits: llama3 RoPE scaling (tied and untied), Qwen2's
q/k/v biases with a sliding window on the upper layer, Qwen3's qk-norm with head_dim
!= dim / heads, Mistral's window (6) shorter than the test sequences (17), Gemma's
(1 + w) norms, scaled embeddings and GeGLU, Gemma 3's sandwich norms, qk-norm,
query_pre_attn_scalar != head_dim, a sliding layer (window 5) with its own RoPE base
beside a global one with linear scaling; Gemma 2's sandwich norms, windows and soft-capped
attention scores and logits (caps small enough to bend these weights' scores and logits);
other rope types ride along (yarn, linear, dynamic) so each is checked against
transformers' own tables.
"""
from __future__ import annotations

import torch
import transformers

from models.hf_fixture import LLAMA3_ROPE, VOCAB, write_char_tokenizer

SEQ = 17  # test sequence length: longer than every window below
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1,
             bos_token_id=2)
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
ARCHS = {
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)),
    "llama3_tied": ("LlamaConfig", dict(rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                  rope_parameters=dict(YARN_ROPE))),
    "qwen3": ("Qwen3Config", dict(head_dim=24, rope_parameters={"rope_type": "linear", "rope_theta": 1e6,
                                                                 "factor": 2.0})),
    "mistral": ("MistralConfig", dict(sliding_window=6, rope_parameters={"rope_type": "dynamic",
                                                                         "rope_theta": 10000.0, "factor": 2.0})),
    "gemma": ("GemmaConfig", dict(head_dim=32, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=5,
                                    layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=1.0,
                                    final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=5,
                                        layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})),
}
# variant -> model_type when not the variant's name
MODEL_TYPE = {"llama3": "llama", "llama3_tied": "llama", "gemma3": "gemma3_text"}


def hf_config(name: str, **shape) -> transformers.PretrainedConfig:
    """`name`'s config at SHAPE, with `shape`'s fields (e.g. num_hidden_layers) replacing its own."""
    cls, kwargs = ARCHS[name]
    shape = {**SHAPE, **shape}
    if "layer_types" in kwargs:  # the variant's pattern, repeated over the layers asked for
        types = kwargs["layer_types"]
        kwargs = {**kwargs, "layer_types": [types[i % len(types)] for i in range(shape["num_hidden_layers"])]}
    return getattr(transformers, cls)(**shape, **kwargs, attn_implementation="eager")


@torch.no_grad()
def make_hf(path: str, name: str, *, seed: int = 0, **shape) -> None:
    """Save a random `name` model (+ tokenizer.json) into `path`. Weights are std 0.1
    and norm scales near 1 (Gemma: its stored w near 0, scale 1 + w), so every tensor
    moves the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **shape)).float()
    unit = 0.0 if name.startswith("gemma") else 1.0
    for pname, p in model.named_parameters():
        noise = torch.randn_like(p) * 0.1
        p.copy_(unit + noise if pname.endswith("norm.weight") else noise)
    model.save_pretrained(path)
    write_char_tokenizer(path)


def load_reference(path: str):
    """The transformers model of `path` in fp32 with eager attention."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def sample_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
