"""Shared pieces of the LoRA tests: a tiny random HF checkpoint, the LoRA config of the
tests, megaft's LoRA model of it, and peft's model of the same adapters."""
from __future__ import annotations

import json

import torch

from megaft.config.lora import LoraConfig
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from megaft.peft.export import peft_name
from megaft.peft.lora import adapters, apply_lora

TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]


def lora_config(**kw) -> LoraConfig:
    return LoraConfig(**{"rank": 4, "alpha": 8.0, "targets": list(TARGETS), **kw})


def megaft_lora_model(ckpt: str, cfg: LoraConfig) -> Decoder:
    """The single-process megaft model of `ckpt` with `cfg`'s adapters (eval mode)."""
    model_cfg = hf_model_config(ckpt)
    model = Decoder(model_cfg)
    load_hf_weights(model, ckpt, tp_rank=0, tp_size=1)
    return apply_lora(model, cfg, seed=0, tp_rank=0, tp_size=1).eval()


@torch.no_grad()
def randomize_adapters(model, seed: int = 1) -> None:
    """Nonzero A and B (B starts at zero: an untrained adapter would hide a wrong B A)."""
    gen = torch.Generator().manual_seed(seed)
    for _, a in adapters(model):
        for p in (a.A, a.B):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def write_data(path) -> str:
    path.write_text("".join(json.dumps({"prompt": f"q{i} ", "completion": f"abc{i % 7}"}) + "\n"
                            for i in range(64)))
    return str(path)


def peft_state(model, arch: str) -> dict[str, torch.Tensor]:
    return {peft_name(f"{m}.adapter.{w}", arch): getattr(a, w).detach().clone()
            for m, a in adapters(model) for w in ("A", "B")}
