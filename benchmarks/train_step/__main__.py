"""Tokens/s, MFU and peak memory of one training step of a model preset on one device,
with the torch paths and with the fused kernels, in one run.

    python -m benchmarks.train_step [--model 1b] [--precision bf16] [--steps N] [--rounds R]
                                    [--batch B] [--seq T] [--providers SPEC ...] [--peak-tflops P]

A step is forward + backward + AdamW on a [batch, seq] random token batch (fp32 master
weights and gradients in FlatParams, autocast at --precision). Each provider is a
KernelsConfig spec (`key=value,...`); the first is the reference the ratios are taken
against. Defaults: on CUDA `backend=torch`, `backend=torch,linear=auto` (the fused
linears alone), `backend=auto` and `backend=auto,fused_linear_cross_entropy=true`; on
CPU the same with triton for auto, interpreted (TRITON_INTERPRET=1, set here), which
checks the wiring and shows the interpreter's cost, not a kernel speed.

The providers are measured in --rounds interleaved rounds, every other one in reverse
order (ABBA for two providers: A B, B A), each turn rebuilding the provider from the
same weights after --warmup untimed steps; a provider's step time is the median of all
its timed steps. A fixed order would hand the warm-up of clocks and caches, and any
drift, to one side.

MFU = tokens/s * model FLOPs per token / peak (megaft.perf.counts: 6 per matmul
weight + attention scores and values at --seq); the peak is --peak-tflops, else the
GPU's dense peak at --precision from megaft.perf.hardware.DEVICES; on CPU "-".
Before the table is trusted, every provider's first-step loss is checked against the
reference's (same weights, same batch): rel 1e-4 in fp32, 2e-2 under bf16/fp16.
An auto op is decided once per provider as training decides it (on CUDA: measured on
these shapes, or cached; megaft.kernels.autotune); the `kernels` column says what ran.
"""
from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.train_step.measure import model_config, run  # noqa: E402
from megaft.perf.counts import flops_per_token, matmul_params, mfu  # noqa: E402
from megaft.perf.hardware import peak_tflops  # noqa: E402


def default_providers(cuda: bool) -> list[str]:
    fused = "auto" if cuda else "triton"
    return ["backend=torch", f"backend=torch,linear={fused}", f"backend={fused}",
            f"backend={fused},fused_linear_cross_entropy=true"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="preset of conf/model/ (1b, small, tiny)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--steps", type=int, default=10, help="timed steps per provider, over all rounds (median)")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved rounds, order reversed every other round (2 = ABBA)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps at the start of each turn (compilation, autotuning, allocator)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default: min(max_seq_len, 2048))")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default: the preset's, else 128256 for 1b, 256 otherwise)")
    p.add_argument("--providers", nargs="+", default=None, help="KernelsConfig specs; the first is the reference")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s for MFU (default: the GPU table)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = model_config(args.model, args.vocab)
    seq = args.seq or min(cfg.max_seq_len, 2048)
    providers = args.providers or default_providers(device.type == "cuda")
    peak = args.peak_tflops or (peak_tflops(torch.cuda.get_device_name(device), args.precision)
                                if device.type == "cuda" else None)
    fpt = flops_per_token(cfg, seq)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model {args.model}: {matmul_params(cfg) / 1e6:.1f}M matmul weights, vocab {cfg.vocab_size}; {name}; "
          f"{args.precision}; batch {args.batch}x{seq}; median of {args.steps} steps in {args.rounds} "
          f"alternating rounds, {args.warmup} warm-up steps per turn; "
          f"{fpt / 1e9:.3f} GFLOP/token; peak {peak or '-'} TFLOP/s")
    results = run(providers, cfg, device=device, batch=args.batch, seq=seq, precision=args.precision,
                  warmup=args.warmup, steps=args.steps, rounds=args.rounds)
    ref = results[0]
    tol = 1e-4 if args.precision == "fp32" else 2e-2
    print(f"{'provider':<52} {'step_ms':>9} {'tokens/s':>10} {'MFU':>6} {'speedup':>7} {'peak_mem_GiB':>12} "
          f"{'loss1':>8} {'valid':>5}  kernels")
    for r in results:
        ok = abs(r.first_loss - ref.first_loss) <= tol * abs(ref.first_loss)
        util = f"{mfu(r.tokens_per_s, fpt, 1, peak):.1%}" if peak else "-"
        mem = f"{r.peak_mem_bytes / 2 ** 30:.2f}" if r.peak_mem_bytes is not None else "-"
        print(f"{r.provider:<52} {r.step_s * 1e3:>9.1f} {r.tokens_per_s:>10.4g} {util:>6} "
              f"{ref.step_s / r.step_s:>6.3g}x {mem:>12} {r.first_loss:>8.4f} {'yes' if ok else 'NO':>5}  {r.kernels}")
    if not all(abs(r.first_loss - ref.first_loss) <= tol * abs(ref.first_loss) for r in results):
        raise SystemExit("a provider's first-step loss differs from the reference: its timing is not valid")


if __name__ == "__main__":
    main()
