"""Kernel microbenchmarks: every fused op of the model against torch, on real model shapes.

    python -m benchmarks.kernels [--op NAME[,NAME]] [--dtype fp32|bf16] [--mode fwd,full]
        [--providers P,...] [--small] [--interpret] [--reps 50] [--warmup 10]
        [--json out.json] [--csv [out.csv]] [--plot DIR]

Ops: rmsnorm, swiglu, rope, cross_entropy, linear_cross_entropy, linear_residual,
linear_swiglu (fused-epilogue GEMMs), grouped_gemm (MoE experts), and adamw (delegated to
``benchmarks.kernels.adamw``, its own table; only with ``--op adamw``). Providers:
torch (eager reference), torch.compile, triton, cuda (megaft._cuda), liger and apex
when they import; unavailable ones are listed as skipped with the reason.

Shapes come from real models on a GPU (hidden 2k..8k, ffn up to 28k, vocab 32k..152k,
8k tokens); ``--small`` (the default on CPU) uses CPU-sized ones, where only torch
eager and torch.compile run: Triton on CPU is interpreted, so it is skipped unless
``--interpret`` asks for it (a correctness run, not a speed number).

Each provider is first checked against the torch reference on a small odd shape,
forward and backward (llm.c: never time a wrong kernel); a mismatch skips it. Then
per shape and mode (fwd; full = fwd + bwd): median time with p20/p80 (CUDA events,
inputs rotated beyond 2x L2; see harness.py), the rate (GB/s for memory-bound ops,
TFLOP/s for the GEMM-bound ops) as % of the copy bandwidth / matmul rate
measured in this run, the speed-up over torch eager ("x torch") and the peak memory
of one call (GPU).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.kernels import harness


def _load_ops():
    from benchmarks.kernels import cross_entropy, grouped_gemm, linear, rmsnorm, rope, swiglu

    return {op.name: op for op in (rmsnorm.OP, swiglu.OP, rope.OP, cross_entropy.CE, cross_entropy.LCE,
                                   linear.RESIDUAL, linear.SWIGLU, grouped_gemm.OP)}


def _outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _call(fn, args, mode: str, grads=None):
    """One forward (no autograd graph) or one forward + backward of fn(*args)."""
    if mode == "fwd":
        with torch.no_grad():
            return fn(*args)
    outs = _outputs(fn(*args))
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return torch.autograd.grad(outs, leaves, grads)


def _grads_for(fn, args, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        outs = _outputs(fn(*args))
    return [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def check(op, provider: str, fn, dtype, device) -> str | None:
    """None when fn matches the reference (outputs and input grads), else why not."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # relative norm error: rounding, not bugs
    args = op.inputs(op.validate_shape, dtype, device, 123)
    ref = op.providers["torch"]
    grads = _grads_for(ref, args, 7)
    try:
        want = _outputs(ref(*args)) + list(_call(ref, args, "full", grads))
        got = _outputs(fn(*args)) + list(_call(fn, args, "full", grads))
    except Exception as e:  # noqa: BLE001 - a provider that raises is reported, not fatal
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {i}: shape {tuple(g.shape)} != reference {tuple(w.shape)}"
        err = _rel_err(g, w)
        if not err <= tol:
            return f"output {i}: relative error {err:.2e} > {tol:.0e} vs the torch reference"
    return None


def bench_op(op, dtype, device, modes, providers, small, interpret, warmup, reps, limits, rows, skipped):
    from benchmarks.kernels.providers import ORDER, compiled, triton_reason

    names = [p for p in list(ORDER) + [p for p in op.providers if p not in ORDER]
             if p in op.providers and (not providers or p in providers)]
    ready = {}
    for name in names:
        reason = triton_reason(device, interpret) if name == "triton" else op.needs.get(name, lambda d: None)(device)
        fn = op.providers[name]
        if reason is None and name == "torch.compile":
            fn = compiled(fn)
        if reason is None:
            reason = check(op, name, fn, dtype, device)
        if reason is not None:
            skipped.append(f"{op.name} {name}: {reason}")
            continue
        ready[name] = fn
    for shape in op.shapes(small):
        sets = [op.inputs(shape, dtype, device, seed) for seed in range(1)]
        set_bytes = sum(t.numel() * t.element_size() for t in sets[0] if isinstance(t, torch.Tensor))
        sets += [op.inputs(shape, dtype, device, seed)
                 for seed in range(1, harness.copies_beyond_l2(set_bytes, device))]
        for mode in modes:
            grads = _grads_for(op.providers["torch"], sets[0], 1) if mode == "full" else None
            base = None
            for name, fn in ready.items():
                calls = [lambda a=a, fn=fn, g=grads: _call(fn, a, mode, g) for a in sets]
                try:
                    times = harness.time_calls(calls, device, warmup, reps)
                    peak = harness.peak_memory(calls[0], device)
                except torch.OutOfMemoryError:
                    skipped.append(f"{op.name} {name} {shape} {mode}: out of memory")
                    torch.cuda.empty_cache()
                    continue
                row = {"op": op.name, "shape": "x".join(map(str, shape)), "dtype": str(dtype).replace("torch.", ""),
                       "mode": mode, "provider": name, **harness.summary(times),
                       "peak_mb": None if peak is None else peak / 2 ** 20}
                work = op.work(shape, dtype, mode)
                secs = row["median_ms"] / 1e3
                if op.kind == "compute":
                    row["rate"], row["rate_unit"] = work / secs / 1e12, "TFLOP/s"
                    row["pct_limit"] = 100 * work / secs / limits["matmul_flops"]
                else:
                    row["rate"], row["rate_unit"] = work / secs / 1e9, "GB/s"
                    row["pct_limit"] = 100 * work / secs / limits["copy_bytes_per_s"]
                if name == "torch":
                    base = row["median_ms"]
                row["vs_torch"] = None if base is None else base / row["median_ms"]
                rows.append(row)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--op", help="comma-separated ops (default: all but adamw)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--mode", default="fwd,full", help="comma-separated: fwd, full (fwd + bwd)")
    ap.add_argument("--providers", help="comma-separated subset of providers")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (default without a GPU)")
    ap.add_argument("--interpret", action="store_true", help="run Triton interpreted on CPU (slow; correctness)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="write rows, skipped providers, limits and the environment here")
    ap.add_argument("--csv", nargs="?", const="-", help="CSV rows to this file (stdout without a name)")
    ap.add_argument("--plot", help="directory for one PNG per op")
    args = ap.parse_args(argv)

    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module imports triton
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    small = args.small or device.type == "cpu"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    ops = _load_ops()
    wanted = args.op.split(",") if args.op else list(ops)
    if "adamw" in wanted:
        from benchmarks.kernels import adamw

        extra = ["--device", device.type, "--dtype", args.dtype or "fp32"]
        if args.json:
            extra += ["--json", os.path.splitext(args.json)[0] + ".adamw.json"]
        if small:
            extra += ["--sizes", "2e6", "--reps", "5"]
        adamw.main(extra)
        wanted.remove("adamw")
    unknown = [w for w in wanted if w not in ops]
    if unknown:
        ap.error(f"unknown op(s) {unknown}; choose from {sorted(ops) + ['adamw']}")
    if not wanted:
        return 0

    warmup, reps = (2, 10) if small else (args.warmup, args.reps)
    limits = {"copy_bytes_per_s": harness.copy_bandwidth(device, warmup, reps),
              "matmul_flops": harness.matmul_rate(device, dtype, warmup, reps), "matmul_dtype": str(dtype)}
    limits.update(copy_gbps=limits["copy_bytes_per_s"] / 1e9, matmul_tflops=limits["matmul_flops"] / 1e12)
    rows, skipped = [], []
    providers = set(args.providers.split(",")) if args.providers else None
    for name in wanted:
        bench_op(ops[name], dtype, device, args.mode.split(","), providers, small, args.interpret, warmup, reps,
                 limits, rows, skipped)
    harness.print_table(rows, skipped, limits)
    if args.json:
        harness.write_json(args.json, rows, skipped, limits, harness.environment(device, argv))
    if args.csv:
        if args.csv == "-":
            harness.write_csv(sys.stdout, rows)
        else:
            with open(args.csv, "w", newline="") as f:
                harness.write_csv(f, rows)
    if args.plot:
        for path in harness.plot(rows, args.plot):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
