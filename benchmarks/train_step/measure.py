"""Providers' train steps, interleaved: build the preset, time fwd + bwd + AdamW, read peak memory.

A provider is a KernelsConfig written as ``key=value,...`` (``backend=torch``,
``backend=auto,fused_linear_cross_entropy=true``). Every provider gets the same seeded
weights and the same token batch, so their first-step losses must agree (validated
before any timing is trusted, as llm.c does). The providers take turns in rounds whose
order alternates (A B C, C B A, ...; ABBA for two), and each one's median is over all
of its turns, so slow drift does not favour whichever side runs first.

An ``auto`` op is decided once per provider before the rounds, as training decides it
(megaft.kernels.autotune.decide_kernels: on CUDA the backend measured fastest on these
shapes, or the cached choice; on CPU torch), and every turn runs that decision.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
import yaml

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig
from megaft.config.optim import OptimConfig
from megaft.kernels.autotune import decide_kernels
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.optim.adamw import AdamW
from megaft.parallel.data.flat import FlatParams
from megaft.report import kernels_cell

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
    step_s: float  # median seconds per train step, over all of the provider's timed steps
    tokens_per_s: float
    first_loss: float
    peak_mem_bytes: Optional[int]  # CUDA max_memory_allocated; None on CPU
    kernels: str = "-"  # the backends the provider ran, in megaft-report's short form


@dataclass
class Block:
    """One provider's turn in a round: its timed steps, first loss and peak memory."""
    times: list[float]
    first_loss: float
    peak_mem_bytes: Optional[int]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decide(provider: str, cfg: ModelConfig, *, device: torch.device, batch: int, seq: int,
           precision: str) -> tuple[KernelsConfig, dict]:
    """The provider's KernelsConfig with its auto ops decided as a training run decides
    them, and the record of what runs each op (summary.json's ``kernels``)."""
    return decide_kernels(kernels_config(provider), cfg, tp=1, batch=batch, seq=seq, precision=precision,
                          device=device)


def block(provider: str, cfg: ModelConfig, *, device: torch.device, batch: int, seq: int, precision: str,
          warmup: int, steps: int, seed: int = 0, kernels: Optional[KernelsConfig] = None) -> Block:
    """Build the provider's model (``kernels``, default the spec as written) from the
    seeded weights, run ``warmup`` untimed then ``steps`` timed train steps; everything
    it built is freed when it returns."""
    model = Decoder(cfg, kernels=kernels or kernels_config(provider))
    init_params(model, cfg, seed=seed, tp_rank=0, tp_size=1)
    model.to(device)
    flat = FlatParams(model, weight_decay=0.1, device=device)
    opt = AdamW(flat, OptimConfig())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, first = timed_steps(model, flat, opt, vocab=cfg.vocab_size, device=device, batch=batch, seq=seq,
                               precision=precision, warmup=warmup, steps=steps, seed=seed)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return Block(times, first, peak)


def timed_steps(model, flat, opt, *, vocab: int, device: torch.device, batch: int, seq: int, precision: str,
                warmup: int, steps: int, seed: int = 0) -> tuple[list[float], float]:
    """(seconds of each timed step, first-step loss): ``warmup`` untimed then ``steps`` timed
    train steps (forward, backward, AdamW) on a seeded batch of ``batch`` x ``seq`` tokens.
    A mixture-of-experts model's objective adds its router terms (load balancing, z-loss) as
    training's does for one micro-batch (megaft.training.step); the loss returned is the
    token loss alone."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    times, first = [], None
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        flat.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model.loss_sum(inputs, labels) / labels.numel()
            router = model.router_losses() if model.cfg.n_experts > 0 else None
        (loss if router is None else loss + router.local).backward()
        opt.step(1e-4)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if first is None:
            first = loss.item()
    return times, first


def round_orders(providers: list[str], rounds: int) -> list[list[str]]:
    """The providers' order in each round, reversed every other round (ABBA for two):
    a drift over the run (clocks, temperature, the machine's load) then costs every
    provider alike instead of the ones that run last."""
    return [list(providers) if r % 2 == 0 else list(reversed(providers)) for r in range(rounds)]


def split_steps(steps: int, rounds: int) -> list[int]:
    """Timed steps per round: ``steps`` in all, as even as possible."""
    if rounds < 1 or steps < rounds:
        raise SystemExit(f"--rounds={rounds} needs 1 <= rounds <= --steps={steps}")
    return [steps // rounds + (r < steps % rounds) for r in range(rounds)]


def run(providers: list[str], cfg: ModelConfig, *, device: torch.device, batch: int, seq: int, precision: str,
        warmup: int, steps: int, rounds: int = 2, seed: int = 0) -> list[Result]:
    """Every provider's median step over ``steps`` timed steps taken in ``rounds``
    interleaved rounds (round_orders); each turn rebuilds the provider from the same
    weights (so only one model is in memory) and starts with ``warmup`` untimed steps.
    Results in the order of ``providers``."""
    decided = {p: decide(p, cfg, device=device, batch=batch, seq=seq, precision=precision) for p in providers}
    blocks: dict[str, list[Block]] = {p: [] for p in providers}
    for order, n in zip(round_orders(providers, rounds), split_steps(steps, rounds)):
        for provider in order:
            blocks[provider].append(block(provider, cfg, device=device, batch=batch, seq=seq, precision=precision,
                                          warmup=warmup, steps=n, seed=seed, kernels=decided[provider][0]))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next provider starts from the same free memory
    results = []
    for provider in providers:
        done = blocks[provider]
        step_s = statistics.median(t for b in done for t in b.times)
        peaks = [b.peak_mem_bytes for b in done if b.peak_mem_bytes is not None]
        results.append(Result(provider, step_s, batch * seq / step_s, done[0].first_loss,
                              max(peaks) if peaks else None, kernels_cell(decided[provider][1]) or "-"))
    return results
