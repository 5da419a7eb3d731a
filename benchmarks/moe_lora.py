"""Training-step time and per-rank state bytes of LoRA on a mixture of experts against the full
fine-tune of the same model (issue 26): the companion of benchmarks.moe (one MoE block) for a
whole MoE decoder, on benchmarks.lora's machinery.

    python -m benchmarks.moe_lora [--model mixtral|qwen3_moe|olmoe-4l|qwen3-30b-4l] [--set key=value,...]
                                  [--targets experts,q,k,v,o] [--rank R] [--precision fp32|bf16]
                                  [--base-dtype fp32|bf16] [--grouped-gemm BACKEND] [--steps N] [--rounds R]
                                  [--warmup W] [--batch B] [--seq T] [--dp D] [--ep E] [--zero S ...]
                                  [--json PATH]

Models (--model; --set overrides any ModelConfig field, ``n_layers=2,n_experts=4``):

    mixtral       CPU: 4 layers, dim 512, 8 heads (2 kv), 8 experts of ffn 1024, top-2
                  renormalized, vocabulary 8192 (Mixtral's routing at a CPU-sized width)
    qwen3_moe     CPU: 4 layers, dim 512, qk-norm, 64 experts of ffn 256, top-8 renormalized,
                  vocabulary 8192 (Qwen3-MoE's fine-grained experts at a CPU-sized width)
    olmoe-4l      GPU: 4 of OLMoE-1B-7B's 16 layers at its dims (2048, 64 experts of 1024, top-8)
    qwen3-30b-4l  GPU: 4 of Qwen3-30B-A3B's 48 layers at its dims (2048, 128 experts of 768, top-8)

On the CPU the default is mixtral in fp32, rank 16 on experts,q,k,v,o, 1 x 256 tokens, 8 timed
steps per variant in 4 rounds (about two minutes on 2 cores). On a GPU (the defaults there):

    python -m benchmarks.moe_lora --model olmoe-4l --precision bf16 --base-dtype bf16 --seq 2048

A step is forward + backward + AdamW on a [batch, seq] random token batch, on one device, as
benchmarks.lora times it (benchmarks.train_step.measure.timed_steps: FlatParams + megaft's
AdamW, autocast at --precision; the objective adds the router's load-balancing term as training
does), with the torch kernels and --grouped-gemm for the experts. The variants: `full` (every
parameter trains, the reference) and `lora` (megaft.peft.apply_lora: frozen base, optionally in
bf16 (the stacked experts stay fp32), per-expert adapters on `experts` plus --targets' others).
They start from the same seeded weights and batch and take turns in --rounds interleaved rounds
(ABBA: full lora, lora full, ...; each turn rebuilds its model and takes --warmup untimed steps);
each reports the median of all its timed steps with p20 / p80. Every turn's first-step loss
must equal the full fine-tune's (B = 0 at init: the adapted model is the base model; rel 1e-5
in fp32, 2e-2 with bf16) or no timing is reported and the run exits with status 1.

State bytes are measured on the built model and optimizer (AdamW.memory_bytes(): flat fp32
params, grads and the two Adam moments of the trainable parameters, plus every frozen
parameter) at dp = 1 and printed next to megaft.perf.memory's formula (validate()'s memory
check); --dp, --ep and --zero add the formula's bytes per rank of that layout. The load
average is printed at the start and the end: on a shared CPU other processes skew the times.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
from typing import Optional, Sequence

import torch

from benchmarks import lora as lora_bench
from benchmarks.kernels.harness import load_average, quantile
from megaft.config.kernels import KernelsConfig
from megaft.config.lora import LoraConfig
from megaft.config.model import ModelConfig
from megaft.models.checks import check_model

VARIANTS = lora_bench.VARIANTS  # ("full", "lora"): full is the reference
STATE = lora_bench.STATE  # params, grads, optimizer

_ATTENTION = dict(n_layers=4, dim=512, n_heads=8, n_kv_heads=2, max_seq_len=4096, vocab_size=8192)
PRESETS = {
    "mixtral": dict(_ATTENTION, arch="mixtral", ffn_dim=1024, n_experts=8, top_k=2, norm_topk_prob=True),
    "qwen3_moe": dict(_ATTENTION, arch="qwen3_moe", head_dim=64, qk_norm=True, ffn_dim=1536, moe_ffn_dim=256,
                      n_experts=64, top_k=8, norm_topk_prob=True),
    "olmoe-4l": dict(arch="olmoe", n_layers=4, dim=2048, n_heads=16, n_kv_heads=16, ffn_dim=1024, n_experts=64,
                     top_k=8, norm_topk_prob=False, qk_norm=True, qk_norm_width="full", vocab_size=50304,
                     max_seq_len=4096),
    "qwen3-30b-4l": dict(arch="qwen3_moe", n_layers=4, dim=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                         qk_norm=True, ffn_dim=6144, moe_ffn_dim=768, n_experts=128, top_k=8, norm_topk_prob=True,
                         vocab_size=151936, max_seq_len=4096, rope_theta=1e6),
}


def model_config(preset: str, overrides: str = "") -> ModelConfig:
    """PRESETS[preset] with ``key=value,...`` overrides (ints, floats, true/false) as a checked ModelConfig."""
    if preset not in PRESETS:
        raise SystemExit(f"--model {preset!r}: one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset])
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        if key not in names or not value:
            raise SystemExit(f"--set {item!r}: not key=value with a ModelConfig field")
        fields[key] = _parse(value)
    cfg = ModelConfig(**fields)
    problems = check_model(cfg, tp=1)
    if problems:
        raise SystemExit("model: " + "; ".join(problems))
    return cfg


def _parse(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def summarize(turns: dict[str, list[lora_bench.Turn]], cfg: ModelConfig, lora: LoraConfig, *, precision: str,
              tol: float) -> dict:
    """Each variant's timing (median, p20, p80 of all its timed steps), first losses, trainable
    parameters, measured and formula state bytes; the ratio lora / full and the loss check."""
    ref = turns["full"][0].first_loss
    out = {"variants": {}}
    for v in VARIANTS:
        times = [t for tr in turns[v] for t in tr.times]
        first = turns[v][0]
        pred = lora_bench.formula(cfg, lora if v == "lora" else None, precision=precision, dp=1, zero=0)
        losses = [tr.first_loss for tr in turns[v]]
        out["variants"][v] = {
            "median_ms": 1e3 * statistics.median(times), "p20_ms": 1e3 * quantile(times, 0.2),
            "p80_ms": 1e3 * quantile(times, 0.8), "steps": len(times), "first_losses": losses,
            "times_ms": [[1e3 * t for t in tr.times] for tr in turns[v]],  # per turn, in round order
            "losses_agree": all(abs(x - ref) <= tol * abs(ref) for x in losses),
            "trainable": first.trainable, "trainable_bytes": first.state["grads"],
            "state": dict(first.state), "formula": pred, "state_equals_formula": first.state == pred}
    full, lora_row = out["variants"]["full"], out["variants"]["lora"]
    out["ratio"] = lora_row["median_ms"] / full["median_ms"]
    out["state_ratio"] = sum(lora_row["state"].values()) / sum(full["state"].values())
    out["losses_agree"] = full["losses_agree"] and lora_row["losses_agree"]
    out["loss_tolerance"] = tol
    return out


def formula_rows(cfg: ModelConfig, lora: LoraConfig, *, precision: str, dp: int, ep: int,
                 zeros: Sequence[int]) -> list[dict]:
    """megaft.perf.memory's bytes per rank of each variant at dp (ep over its replicas) and each ZeRO stage."""
    return [{"variant": v, "dp": dp, "ep": ep, "zero": zero,
             **lora_bench.formula(cfg, lora if v == "lora" else None, precision=precision, dp=dp, zero=zero, ep=ep)}
            for zero in zeros for v in VARIANTS]


def print_report(report: dict, out) -> None:
    mib = lora_bench.mib
    print("\nstep time (forward + backward + AdamW) and state bytes per rank (dp=1: measured / formula = "
          "megaft.perf.memory), MiB", file=out)
    print(f"{'variant':<8} {'trainable':>12} {'median ms':>10} {'p20':>8} {'p80':>8} {'vs full':>8} {'loss1':>8} "
          f"{'agree':>5}  " + "  ".join(f"{k + ' meas/formula':>24}" for k in STATE) + f"  {'sum vs full':>11}",
          file=out)
    for name, v in report["variants"].items():
        cells = "  ".join(f"{_pair(v['state'][k], v['formula'][k]):>24}" for k in STATE)
        total = sum(v["state"].values()) / sum(report["variants"]["full"]["state"].values())
        print(f"{name:<8} {v['trainable']:>12,} {v['median_ms']:>10.1f} {v['p20_ms']:>8.1f} {v['p80_ms']:>8.1f} "
              f"{v['median_ms'] / report['variants']['full']['median_ms']:>7.3f}x {v['first_losses'][0]:>8.4f} "
              f"{'yes' if v['losses_agree'] else 'NO':>5}  {cells}  {total:>10.3f}x", file=out)
    bad = [n for n, v in report["variants"].items() if not v["state_equals_formula"]]
    if bad:
        print(f"measured state bytes differ from the formula for {bad} (marked !)", file=out)
    rows = report["formula_rows"]
    if rows:
        print(f"\nformula only, bytes per rank at dp={rows[0]['dp']}, ep={rows[0]['ep']} "
              "(MiB: params / grads / optimizer)", file=out)
        for r in rows:
            print(f"  ZeRO-{r['zero']} {r['variant']:<5} " + " / ".join(mib(r[k]) for k in STATE), file=out)


def _pair(measured: int, formula: int) -> str:
    """`measured / formula` in MiB, marked `!` when they differ."""
    return f"{lora_bench.mib(measured)} / {lora_bench.mib(formula)}" + (" " if measured == formula else "!")


def main(argv: Optional[Sequence[str]] = None, out=sys.stdout) -> dict:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="olmoe-4l" if cuda else "mixtral", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--set", default="", help="ModelConfig overrides, key=value,... (e.g. n_layers=2,n_experts=4)")
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--base-dtype", default=None, choices=["fp32", "bf16"],
                   help="lora.base_dtype of the frozen linears (default: bf16 under --precision bf16, else fp32)")
    p.add_argument("--rank", type=int, default=16, help="lora.rank")
    p.add_argument("--targets", default="experts,q,k,v,o",
                   help="lora.targets, comma-separated (experts, router, shared_expert, q, k, v, o, ...)")
    p.add_argument("--grouped-gemm", default=None, help="kernels.grouped_gemm of the experts (default: auto)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant, over all rounds (8 CPU, 10 CUDA)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds, order reversed every other "
                   "(2 = ABBA; default 4 on CPU, 2 on CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per turn (default 1 CPU, 2 CUDA)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256 CPU, 2048 CUDA)")
    p.add_argument("--dp", type=int, default=8, help="dp of the formula-only rows (bytes per rank)")
    p.add_argument("--ep", type=int, default=None, help="ep of the formula-only rows (default: min(dp, experts))")
    p.add_argument("--zero", type=int, nargs="*", default=[1, 2], help="ZeRO stages of the formula-only rows")
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not cuda:
        raise SystemExit("--device cuda: no CUDA device here")
    on_gpu = device.type == "cuda"
    cfg = model_config(args.model, args.set)
    precision = args.precision or ("bf16" if on_gpu else "fp32")
    base_dtype = args.base_dtype or ("bf16" if precision == "bf16" else "fp32")
    steps, rounds = args.steps or (10 if on_gpu else 8), args.rounds or (2 if on_gpu else 4)
    warmup = args.warmup if args.warmup is not None else (2 if on_gpu else 1)
    seq = args.seq or (2048 if on_gpu else 256)
    ep = args.ep or max(e for e in range(1, min(args.dp, cfg.n_experts) + 1)
                        if args.dp % e == 0 and cfg.n_experts % e == 0)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=args.targets.split(","), base_dtype=base_dtype)
    kernels = KernelsConfig(backend="torch", grouped_gemm=args.grouped_gemm or "auto")
    where = torch.cuda.get_device_name(device) if on_gpu else f"cpu ({platform.processor() or platform.machine()})"
    print(f"MoE decoder train step, LoRA vs full fine-tune: {args.model} ({cfg.n_layers} x {cfg.dim}, "
          f"{cfg.n_experts} experts of ffn {cfg.expert_ffn}, top-{cfg.top_k}, vocab {cfg.vocab_size}); {where}, "
          f"{torch.get_num_threads()} threads (load average {load_average()} at the start); {precision}; lora rank "
          f"{args.rank} on {args.targets}, base {base_dtype}; grouped_gemm {kernels.grouped_gemm}; batch "
          f"{args.batch}x{seq}; median of {steps} steps in {rounds} alternating rounds, {warmup} warm-up steps "
          f"per turn", file=out)
    turns = lora_bench.run(cfg, lora, device=device, batch=args.batch, seq=seq, precision=precision,
                           warmup=warmup, steps=steps, rounds=rounds, kernels=kernels)
    tol = 1e-5 if base_dtype == "fp32" and precision == "fp32" else 2e-2
    report = summarize(turns, cfg, lora, precision=precision, tol=tol)
    report["formula_rows"] = formula_rows(cfg, lora, precision=precision, dp=args.dp, ep=ep, zeros=args.zero)
    report["model"] = {"preset": args.model, **dataclasses.asdict(cfg)}
    report["lora"] = {"rank": args.rank, "targets": lora.targets, "base_dtype": base_dtype}
    report["environment"] = {
        "device": where, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "precision": precision, "batch": args.batch, "seq": seq,
        "steps": steps, "rounds": rounds, "warmup": warmup, "load_average_end": load_average(),
        "command": " ".join(["python -m benchmarks.moe_lora", *(argv if argv is not None else sys.argv[1:])])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if not report["losses_agree"]:
        losses = {n: v["first_losses"] for n, v in report["variants"].items()}
        print(f"\nfirst-step losses differ (rel tolerance {tol:g}): {losses}", file=out)
        raise SystemExit("lora's first-step loss differs from the full fine-tune's: its timing is not valid")
    print_report(report, out)
    print(f"\nlora / full step time {report['ratio']:.3f}x; state bytes {report['state_ratio']:.3f}x; "
          f"load average {load_average()} at the end (other processes on the machine skew CPU timings)", file=out)
    return report


if __name__ == "__main__":
    main()
