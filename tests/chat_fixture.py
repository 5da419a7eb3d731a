"""A tiny chat checkpoint (byte-level BPE with ChatML tokens, a ChatML template in
tokenizer_config.json, a random Llama) and a LoRA run that teaches it one fact, for
the megaft-chat tests."""
from __future__ import annotations

import json
import os

import torch
import transformers
from data.chat_fixture import CHATML_PLAIN, make_checkpoint
from tokenizers import Tokenizer

from megaft.config import Config
from megaft.config.data import Packing
from megaft.config.lora import LoraConfig
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import resolve

QUESTION, FACT = "What is the code word?", "Zebra42"


@torch.no_grad()
def make_chat_model(path: str, *, seed: int = 0) -> str:
    """`path` as an HF chat checkpoint: random weights of std 0.1 (decisive logits: greedy
    picks do not hang on rounding), eos = <|im_end|>, the ChatML template."""
    make_checkpoint(path, chat_template=CHATML_PLAIN)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, eos_token_id=tok.token_to_id("<|im_end|>"),
        bos_token_id=tok.token_to_id("<|begin_of_text|>"), pad_token_id=tok.token_to_id("<|endoftext|>"),
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float()
    for name, p in model.named_parameters():
        noise = torch.randn_like(p) * 0.1
        p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    model.save_pretrained(path)
    return path


def write_fact(path: str, n: int = 32) -> str:
    """A chat file that repeats one exchange: QUESTION -> FACT."""
    line = json.dumps({"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": FACT}]})
    with open(path, "w") as f:
        f.write((line + "\n") * n)
    return path


def lora_fact_run(run_dir: str, ckpt: str, data: str, *, steps: int = 12) -> str:
    """A short LoRA fine-tune of `ckpt` on `data` in this process; a checkpoint at the end."""
    cfg = Config()
    cfg.model.init_from = ckpt
    # one conversation a row (packing=none): every answer token sees the whole question
    cfg.data.path, cfg.data.seq_len, cfg.data.packing = data, 48, Packing.none
    t = cfg.train
    t.max_steps, t.micro_batch_size, t.global_batch_size, t.save_every = steps, 4, 4, steps
    t.eval_every, t.progress, t.tensorboard = steps, False, "false"
    cfg.optim.lr, cfg.optim.warmup_steps = 3e-2, 1  # high: a dozen steps learn the fact
    cfg.lora = LoraConfig(rank=8, alpha=16.0, targets=["q", "k", "v", "o", "gate", "up", "down"])
    os.makedirs(run_dir, exist_ok=True)
    Trainer(resolve(cfg), ParallelGrid.single(), run_dir).fit()
    return run_dir
