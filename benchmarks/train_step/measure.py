"""One provider's train steps: build the preset, time fwd + bwd + AdamW, read peak memory.

A provider is a KernelsConfig written as ``key=value,...`` (``backend=torch``,
``backend=auto,fused_linear_cross_entropy=true``). Every provider gets the same seeded
weights and the same token batch, so their first-step losses must agree (validated
before any timing is trusted, as llm.c does).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
import yaml

from megaft.kernels.config import KernelsConfig
from megaft.models.config import ModelConfig
from megaft.models.init import init_params
from megaft.models.llama import Llama
from megaft.optim.adamw import AdamW
from megaft.optim.config import OptimConfig
from megaft.optim.flat import FlatParams

# vocab_size 0 in a preset means "the tokenizer's": the benchmark has none, so it takes
# the real model's (Llama 3's tokenizer for the 1b preset).
DEFAULT_VOCAB = {"1b": 128256}


def model_config(preset: str, vocab: Optional[int]) -> ModelConfig:
    """conf/model/<preset>.yaml as a ModelConfig (without Hydra: only the plain fields)."""
    with open(f"conf/model/{preset}.yaml") as f:
        fields = {k: v for k, v in yaml.safe_load(f).items() if k != "defaults"}
    cfg = ModelConfig(**fields)
    cfg.vocab_size = vocab or cfg.vocab_size or DEFAULT_VOCAB.get(preset, 256)
    return cfg


def kernels_config(spec: str) -> KernelsConfig:
    """``key=value,...`` -> KernelsConfig (true/false and ints parsed)."""
    cfg = KernelsConfig()
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if not hasattr(cfg, key):
            raise SystemExit(f"unknown kernels field {key!r} in provider {spec!r}")
        parsed = {"true": True, "false": False}.get(value.lower(), value)
        setattr(cfg, key, int(parsed) if isinstance(parsed, str) and parsed.isdigit() else parsed)
    return cfg


@dataclass
class Result:
    provider: str
    step_s: float  # median seconds per train step
    tokens_per_s: float
    first_loss: float
    peak_mem_bytes: Optional[int]  # CUDA max_memory_allocated; None on CPU


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(provider: str, cfg: ModelConfig, *, device: torch.device, batch: int, seq: int, precision: str,
        warmup: int, steps: int, seed: int = 0) -> Result:
    model = Llama(cfg, kernels=kernels_config(provider))
    init_params(model, cfg, seed=seed, tp_rank=0, tp_size=1)
    model.to(device)
    flat = FlatParams(model, weight_decay=0.1, device=device)
    opt = AdamW(flat, OptimConfig())
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times, first = [], None
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        flat.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model.loss_sum(inputs, labels) / labels.numel()
        loss.backward()
        opt.step(1e-4)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if first is None:
            first = loss.item()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    step_s = statistics.median(times)
    return Result(provider, step_s, batch * seq / step_s, first, peak)
