"""Step time and per-rank state bytes of a LoRA fine-tune against the full fine-tune of the
same model, in one run (issue 15).

    python -m benchmarks.lora [--model PRESET] [--precision fp32|bf16] [--base-dtype fp32|bf16]
                              [--rank R] [--targets q,k,v,o,gate,up,down] [--steps N] [--rounds R]
                              [--batch B] [--seq T] [--vocab V] [--dp D] [--zero S]

On a GPU (the command to run; the defaults there are these):

    python -m benchmarks.lora --model 1b --precision bf16 --base-dtype bf16 --rank 16 --seq 2048

On CPU the defaults are the `small` preset (12 x 768) with an 8192-token vocabulary, fp32,
batch 1 x 256, 16 timed steps in 4 rounds, so it finishes in about a minute:

    python -m benchmarks.lora

A step is forward + backward + AdamW on a [batch, seq] random token batch, on one device,
as `benchmarks.train_step` times it (FlatParams + megaft's AdamW, autocast at --precision),
with the torch kernels (kernels.backend=torch) for both variants.
The two variants, `full` (every parameter trains: the reference the ratios are taken
against) and `lora` (megaft.peft.apply_lora: frozen base, optionally stored in bf16, and
adapters of rank --rank on --targets), start from the same seeded weights and batch, take
turns in --rounds interleaved rounds (ABBA: full lora, lora full, ...; each turn rebuilds
its model after --warmup untimed steps) and report the median of all their timed steps.
Their first-step losses must agree (B = 0 at init: the adapted model is the base model;
rel 1e-5 in fp32, 2e-2 with a bf16 base) before the timings are trusted.

State bytes are measured on the built model and optimizer (`AdamW.memory_bytes()`: the
flat fp32 params, grads and the two Adam moments of the trainable parameters; plus every
frozen parameter's bytes) and printed next to the formula that validate()'s memory check
uses (megaft.perf.memory: params 4 + grads 4 + moments 8 bytes per trainable parameter,
frozen base bytes in --base-dtype). The measured run is one rank with dp = 1; --dp and
--zero add the formula's bytes per rank of that layout (ZeRO-1 shards the moments over dp,
ZeRO-2 the grads too; measured at dp = 2 in tests/lora/test_lora_training.py).
"""
from __future__ import annotations

import argparse
import gc
import statistics
from dataclasses import dataclass
from typing import Optional

import torch

from benchmarks.train_step.measure import model_config, round_orders, split_steps, timed_steps
from megaft.config import Config
from megaft.config.kernels import KernelsConfig
from megaft.config.lora import LoraConfig
from megaft.config.model import ModelConfig
from megaft.config.optim import OptimConfig
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.optim.adamw import AdamW
from megaft.parallel.data.flat import FlatParams
from megaft.peft.lora import apply_lora
from megaft.perf.memory import estimate_ranks

VARIANTS = ("full", "lora")
STATE = ("params", "grads", "optimizer")


@dataclass
class Turn:
    times: list[float]
    first_loss: float
    state: dict[str, int]  # measured bytes: params (frozen + trainable), grads, optimizer
    trainable: int


def build(variant: str, cfg: ModelConfig, lora: LoraConfig, device: torch.device, seed: int,
          kernels: Optional[KernelsConfig] = None):
    """(model, FlatParams, AdamW) of `variant` from the seeded weights (`kernels`: default the
    torch kernels)."""
    model = Decoder(cfg, kernels=kernels or KernelsConfig(backend="torch"))
    init_params(model, cfg, seed=seed, tp_rank=0, tp_size=1)
    if variant == "lora":
        apply_lora(model, lora, seed=seed, tp_rank=0, tp_size=1)
    model.to(device)
    flat = FlatParams(model, weight_decay=0.1, device=device)
    return model, flat, AdamW(flat, OptimConfig())


def measured_state(model, opt) -> dict[str, int]:
    held = opt.memory_bytes()
    frozen = sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    return {"params": frozen + held["params"], "grads": held["grads"], "optimizer": held["optimizer"]}


def turn(variant: str, cfg: ModelConfig, lora: LoraConfig, *, device: torch.device, batch: int, seq: int,
         precision: str, warmup: int, steps: int, seed: int = 0, kernels: Optional[KernelsConfig] = None) -> Turn:
    model, flat, opt = build(variant, cfg, lora, device, seed, kernels)
    state = measured_state(model, opt)
    times, first = timed_steps(model, flat, opt, vocab=cfg.vocab_size, device=device, batch=batch, seq=seq,
                               precision=precision, warmup=warmup, steps=steps, seed=seed)
    trainable = sum(p.numel() for p in flat.params)
    return Turn(times, first, state, trainable)


def formula(cfg: ModelConfig, lora: Optional[LoraConfig], *, precision: str, dp: int, zero: int,
            ep: int = 1) -> dict[str, int]:
    """The fullest rank's params/grads/optimizer bytes by megaft.perf.memory (validate()'s check)."""
    run = Config()
    run.model, run.precision = cfg, precision
    run.parallel.dp, run.parallel.zero, run.parallel.ep = dp, zero, ep
    run.lora = lora if lora is not None else LoraConfig(rank=0)
    est = max(estimate_ranks(run, dp), key=lambda e: e.params + e.grads + e.optimizer)
    return {k: getattr(est, k) for k in STATE}


def run(cfg: ModelConfig, lora: LoraConfig, *, device: torch.device, batch: int, seq: int, precision: str,
        warmup: int, steps: int, rounds: int, kernels: Optional[KernelsConfig] = None) -> dict[str, list[Turn]]:
    turns: dict[str, list[Turn]] = {v: [] for v in VARIANTS}
    for order, n in zip(round_orders(list(VARIANTS), rounds), split_steps(steps, rounds)):
        for variant in order:
            turns[variant].append(turn(variant, cfg, lora, device=device, batch=batch, seq=seq,
                                       precision=precision, warmup=warmup, steps=n, kernels=kernels))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return turns


def mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f}"


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b" if cuda else "small", help="preset of conf/model/ (1b, small, tiny)")
    p.add_argument("--vocab", type=int, default=None if cuda else 8192,
                   help="vocabulary size (default: the preset's, 128256 for 1b; 8192 on CPU)")
    p.add_argument("--precision", default="bf16" if cuda else "fp32", choices=["fp32", "bf16"])
    p.add_argument("--base-dtype", default=None, choices=["fp32", "bf16"],
                   help="lora.base_dtype of the frozen linears (default: bf16 under --precision bf16, else fp32)")
    p.add_argument("--rank", type=int, default=16, help="lora.rank")
    p.add_argument("--targets", default="q,k,v,o,gate,up,down", help="lora.targets, comma-separated")
    p.add_argument("--steps", type=int, default=10 if cuda else 16, help="timed steps per variant, over all rounds")
    p.add_argument("--rounds", type=int, default=2 if cuda else 4,
                   help="interleaved rounds, order reversed every other (2 = ABBA; default 2, 4 on CPU)")
    p.add_argument("--warmup", type=int, default=2 if cuda else 1, help="untimed steps at the start of each turn")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 2048 on CUDA, 256 on CPU)")
    p.add_argument("--dp", type=int, default=8, help="dp of the extra formula-only rows (bytes per rank)")
    p.add_argument("--zero", type=int, nargs="+", default=[1, 2], help="ZeRO stages of the formula-only rows")
    args = p.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = model_config(args.model, args.vocab)
    seq = args.seq or (min(cfg.max_seq_len, 2048) if cuda else 256)
    base_dtype = args.base_dtype or ("bf16" if args.precision == "bf16" else "fp32")
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=args.targets.split(","), base_dtype=base_dtype)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"model {args.model} ({cfg.n_layers} x {cfg.dim}, vocab {cfg.vocab_size}); {name}; {args.precision}; "
          f"lora rank {args.rank} on {args.targets}, base {base_dtype}; batch {args.batch}x{seq}; median of "
          f"{args.steps} steps in {args.rounds} alternating rounds, {args.warmup} warm-up steps per turn")
    turns = run(cfg, lora, device=device, batch=args.batch, seq=seq, precision=args.precision,
                warmup=args.warmup, steps=args.steps, rounds=args.rounds)
    step = {v: statistics.median(t for tr in turns[v] for t in tr.times) for v in VARIANTS}
    first = {v: turns[v][0] for v in VARIANTS}
    tol = 1e-5 if base_dtype == "fp32" and args.precision == "fp32" else 2e-2
    ref = first["full"].first_loss
    print("\nstep time and state bytes per rank (dp=1, measured; formula = megaft.perf.memory), MiB")
    print(f"{'variant':<8} {'trainable':>11} {'step_ms':>9} {'vs full':>8} {'loss1':>8} {'valid':>5}  "
          + "  ".join(f"{k + ' meas/formula':>24}" for k in STATE) + f"  {'sum vs full':>11}")
    total_full = sum(first["full"].state.values())
    for v in VARIANTS:
        t = first[v]
        pred = formula(cfg, lora if v == "lora" else None, precision=args.precision, dp=1, zero=0)
        ok = abs(t.first_loss - ref) <= tol * abs(ref)
        cells = "  ".join(f"{mib(t.state[k]) + ' / ' + mib(pred[k]) + (' ' if t.state[k] == pred[k] else '!'):>24}"
                          for k in STATE)
        print(f"{v:<8} {t.trainable:>11,} {step[v] * 1e3:>9.1f} {step[v] / step['full']:>7.3f}x {t.first_loss:>8.4f} "
              f"{'yes' if ok else 'NO':>5}  {cells}  {sum(t.state.values()) / total_full:>10.3f}x")
    print(f"\nformula only, bytes per rank at dp={args.dp} (MiB: params / grads / optimizer)")
    for zero in args.zero:
        for v in VARIANTS:
            pred = formula(cfg, lora if v == "lora" else None, precision=args.precision, dp=args.dp, zero=zero)
            print(f"  ZeRO-{zero} {v:<5} " + " / ".join(mib(pred[k]) for k in STATE))
    mismatched = [v for v in VARIANTS if first[v].state != formula(
        cfg, lora if v == "lora" else None, precision=args.precision, dp=1, zero=0)]
    if mismatched:
        print(f"measured state bytes differ from the formula for {mismatched} (marked !)")
    if not all(abs(first[v].first_loss - ref) <= tol * abs(ref) for v in VARIANTS):
        raise SystemExit("lora's first-step loss differs from the full fine-tune's: its timing is not valid")


if __name__ == "__main__":
    main()
