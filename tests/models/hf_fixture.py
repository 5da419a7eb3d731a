"""Random Hugging Face Llama checkpoints for the HF import/export tests."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import transformers
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from megaft.models.hf.load import checkpoint_files

VOCAB = 61  # odd: tp=2 pads the vocabulary to 62, so padding rows are exercised
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ012345"  # 58 + 3 specials = 61
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}


def write_char_tokenizer(path: str) -> str:
    """A character-level WordLevel tokenizer.json of VOCAB tokens (<pad>=0, <eos>=1, <unk>=2)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    file = os.path.join(path, "tokenizer.json")
    tok.save(file)
    return file


def hf_config(*, tie: bool = False, bias: bool = False, rope: Optional[dict[str, Any]] = None
              ) -> transformers.LlamaConfig:
    """Tiny GQA Llama: 4 query heads over 2 kv heads, fp32 eager attention."""
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        attention_bias=bias, mlp_bias=bias,
        rope_parameters=dict(rope or {"rope_type": "default", "rope_theta": 10000.0}),
        pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="eager")


@torch.no_grad()
def make_hf_llama(path: str, *, seed: int = 0, max_shard_size: Optional[int] = None, **config) -> None:
    """Save a randomly initialized LlamaForCausalLM (+ tokenizer.json) into `path`.

    Weights are redrawn with std 0.1 and norm weights near 1 (not HF's ones / 0.02),
    so every tensor, including biases and norms, moves the logits."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(**config)).float()
    for name, p in model.named_parameters():
        noise = torch.randn_like(p) * 0.1
        p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    write_char_tokenizer(path)


def load_reference(path: str) -> transformers.LlamaForCausalLM:
    """The HF model of `path` in fp32 with eager attention, for reference logits."""
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def padded_lines(lengths: list[int], *, seed: int, low: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded lines of the given lengths (token ids in [low, VOCAB)); labels are the
    next tokens, -100 on padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(low, VOCAB, (n,), generator=gen)
        labels[i, : n - 1] = ids[i, 1:n]
    return ids, labels


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the HF checkpoint folder `path` (one file or sharded), by name."""
    out = {}
    for name, file in checkpoint_files(path).items():
        with safe_open(file, "pt") as f:
            out[name] = f.get_tensor(name)
    return out
