"""AdamW step over a model-shaped list of tensors: torch's optimizers, megaft's kernels
and apex, with the device's copy bandwidth measured in the same run.

    python -m benchmarks.kernels.adamw [--device auto|cpu|cuda] [--sizes 10e6,100e6,1e9]
        [--providers torch.foreach,torch.fused,megaft.triton,megaft.cuda,apex.FusedAdam]
        [--dtype fp32|bf16] [--reps 20] [--warmup 3] [--threads N] [--json out.json]

Providers: torch.foreach and torch.fused (torch.optim.AdamW), megaft.triton and
megaft.cuda (multi-tensor kernels, GPU), megaft._C (CPU), apex.FusedAdam (GPU, when
apex imports). Unavailable ones are listed with the reason and skipped.

Parameters: N elements cut into the tensors of Llama-like layers of width 1024
(four 1024x1024 attention matrices, three 1024x2816 MLP matrices, two norms; ~12.7M
per layer, the last tensor cut short), so 10M params are 7 tensors and 1B ~700:
the per-tensor launch overhead a multi-tensor kernel removes is in the numbers.

Bytes moved: 28 per param, the minimum traffic of one step. fp32: read p, g, m, v and
write p, m, v (7 x 4 B). ``--dtype bf16`` (megaft and apex-free providers only): bf16
params and grads with fp32 masters: read g (2), m, v, master (12), write m, v, master
(12), p (2) = 28 B as well; torch's optimizers cannot keep fp32 masters, so they run on
fp32 params there (their rows say so). The copy reference moves the same 28 B/param
(a device-to-device copy of 14 B/param: read + write), so "% copy" is the fraction of
the device's streaming bandwidth an AdamW step reaches.

Every provider is first validated against torch.optim.AdamW(foreach=False) on a small
list (llm.c's rule: no timing of a wrong kernel). Timing: median (p20, p80) over
--reps steps after --warmup steps; CUDA events on GPU, providers one after another
(their state would not fit at once at 1B params); on CPU a wall clock with the
providers taking turns rep by rep, so that load from other processes hits all alike.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from megaft.kernels import _ext, _triton
from megaft.kernels.adamw import adamw_multi_tensor_

BYTES_PER_PARAM = 28
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
GPU_PROVIDERS = ("torch.foreach", "torch.fused", "megaft.triton", "megaft.cuda", "apex.FusedAdam")
CPU_PROVIDERS = ("torch.foreach", "torch.fused", "megaft._C")
_BACKEND_OF = {"megaft.triton": "triton", "megaft.cuda": "cuda", "megaft._C": "cpu"}
_LAYER = [1024 * 1024] * 4 + [1024 * 2816] * 3 + [1024] * 2


def layer_sizes(n: int) -> list[int]:
    """N parameters as the tensor sizes of whole Llama-like layers (see module doc)."""
    sizes, left = [], n
    while left > 0:
        for s in _LAYER:
            sizes.append(min(s, left))
            left -= sizes[-1]
            if left == 0:
                break
    return sizes


def unavailable(provider: str, device: torch.device) -> str | None:
    """Why ``provider`` cannot run on ``device`` (None: it can)."""
    if provider in ("torch.foreach", "torch.fused"):
        return None
    if provider == "megaft._C":
        return None if device.type == "cpu" and _ext.C.available else (
            _ext.C.error or "CPU only")
    if device.type != "cuda":
        return "GPU only"
    if provider == "megaft.triton":
        return _triton.unavailable_reason(device)
    if provider == "megaft.cuda":
        return _ext.CUDA.error
    try:
        importlib.import_module("apex.optimizers")
    except ImportError as e:
        return f"apex does not import ({e})"
    return None


def setup(provider: str, sizes: list[int], device: torch.device, dtype: str,
          seed: int = 0) -> tuple[Callable[[], None], list[torch.Tensor], Callable]:
    """(step function, fp32 view of the params after stepping, state getter) for
    ``provider`` on fresh tensors of ``sizes``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    masters = [torch.randn(n, generator=gen, device=device) for n in sizes]
    grads = [torch.randn(n, generator=gen, device=device) for n in sizes]
    if provider in _BACKEND_OF:
        bf16 = dtype == "bf16"
        params = [m.bfloat16() for m in masters] if bf16 else masters
        grads = [g.bfloat16() for g in grads] if bf16 else grads
        exp_avgs = [torch.zeros_like(m) for m in masters]
        exp_avg_sqs = [torch.zeros_like(m) for m in masters]
        count = [0]

        def step() -> None:
            count[0] += 1
            adamw_multi_tensor_(params, grads, exp_avgs, exp_avg_sqs, step=count[0],
                                master_params=masters if bf16 else None,
                                backend=_BACKEND_OF[provider], **HP)

        return step, masters, lambda: (exp_avgs, exp_avg_sqs)
    params = [torch.nn.Parameter(m) for m in masters]
    for p, g in zip(params, grads):
        p.grad = g
    kw = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
              weight_decay=HP["weight_decay"])
    if provider == "apex.FusedAdam":
        from apex.optimizers import FusedAdam

        opt = FusedAdam(params, adam_w_mode=True, **kw)
    else:
        opt = torch.optim.AdamW(params, **kw, **({"foreach": True} if provider == "torch.foreach"
                                                 else {"fused": True}))
    state = lambda: ([opt.state[p]["exp_avg"] for p in params],  # noqa: E731
                     [opt.state[p]["exp_avg_sq"] for p in params])
    return opt.step, [p.detach() for p in params], state


def validate(provider: str, device: torch.device, dtype: str) -> None:
    """``provider`` against torch.optim.AdamW(foreach=False) for 3 steps on a small
    odd-sized list; tolerances cover torch's approximate GPU division and, for bf16,
    the bf16 rounding of the gradients fed to the reference too."""
    sizes = [1_000_003, 4099, 1]
    step, params, state = setup(provider, sizes, device, dtype, seed=1)
    gen = torch.Generator(device=device).manual_seed(1)
    ref = [torch.nn.Parameter(torch.randn(n, generator=gen, device=device)) for n in sizes]
    for p, n in zip(ref, sizes):  # same draws as setup(): all params, then all grads
        g = torch.randn(n, generator=gen, device=device)
        p.grad = g.bfloat16().float() if dtype == "bf16" and provider in _BACKEND_OF else g
    opt = torch.optim.AdamW(ref, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=False)
    for _ in range(3):
        step()
        opt.step()
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5 * HP["lr"],
                                   msg=lambda m: f"{provider} differs from torch.optim.AdamW: {m}")
    for a, b in zip(state()[1], [opt.state[p]["exp_avg_sq"] for p in ref]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9, msg=lambda m: f"{provider}: {m}")


def time_gpu(fn: Callable[[], None], warmup: int, reps: int) -> list[float]:
    """Milliseconds per call from CUDA events (one pair per call)."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_cpu_interleaved(fns: dict[str, Callable[[], None]], warmup: int,
                         reps: int) -> dict[str, list[float]]:
    """Milliseconds per call, providers taking turns rep by rep (synchronous CPU code:
    a wall clock is exact)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def copy_fn(n: int, device: torch.device) -> Callable[[], None]:
    """A device-to-device copy moving the bytes of an n-param AdamW step (see doc)."""
    elems = BYTES_PER_PARAM * n // 2 // 4
    src = torch.ones(elems, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def row(provider: str, n: int, n_tensors: int, dtype: str, t: list[float]) -> dict:
    ms = statistics.median(t)
    # torch's and apex's optimizers always run fp32 params; the copy has no dtype.
    dtype = dtype if provider in _BACKEND_OF else "-" if provider == "copy" else "fp32"
    return dict(kernel="adamw", provider=provider, mode="step", numel=n, tensors=n_tensors,
                dtype=dtype, ms_p50=ms, ms_p20=quantile(t, .2),
                ms_p80=quantile(t, .8), gbps=BYTES_PER_PARAM * n / (ms * 1e-3) / 1e9)


def run(device: torch.device, sizes: list[int], providers: list[str], dtype: str, warmup: int,
        reps: int) -> list[dict]:
    rows = []
    for n in sizes:
        shapes = layer_sizes(n)
        if device.type == "cuda":
            times = {}
            for name in ["copy", *providers]:
                fn = copy_fn(n, device) if name == "copy" else setup(name, shapes, device, dtype)[0]
                times[name] = time_gpu(fn, warmup, reps)
                del fn
                gc.collect()
                torch.cuda.empty_cache()
        else:
            fns = {"copy": copy_fn(n, device)}
            fns.update((p, setup(p, shapes, device, dtype)[0]) for p in providers)
            times = time_cpu_interleaved(fns, warmup, reps)
            del fns
            gc.collect()
        new = [row(p, n, len(shapes), dtype, t) for p, t in times.items()]
        base = {r["provider"]: r["ms_p50"] for r in new}
        for r in new:
            r["pct_of_copy"] = 100 * base["copy"] / r["ms_p50"]
            if "torch.fused" in base:
                r["speedup_vs_torch_fused"] = base["torch.fused"] / r["ms_p50"]
        rows += new
    return rows


def environment(device: torch.device) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
                gpu=gpu, cpu=cpu, threads=torch.get_num_threads(),
                capability=torch.backends.cpu.get_cpu_capability(),
                c_build=_ext.C.module.build_info() if _ext.C.available else None, commit=commit,
                command=" ".join([sys.executable, "-m", "benchmarks.kernels.adamw"] + sys.argv[1:]))


def print_table(rows: list[dict]) -> None:
    print(f"{'params':>13} {'tensors':>7} {'provider':<15} {'dtype':<5} {'ms/step':>9} "
          f"{'p20-p80':>15} {'GB/s':>8} {'% copy':>7} {'vs torch.fused':>15}")
    for r in rows:
        vs = r.get("speedup_vs_torch_fused")
        print(f"{r['numel']:>13,} {r['tensors']:>7} {r['provider']:<15} {r['dtype']:<5} "
              f"{r['ms_p50']:>9.3f} {r['ms_p20']:>7.3f}-{r['ms_p80']:<7.3f} {r['gbps']:>8.1f} "
              f"{r['pct_of_copy']:>6.1f}% {(f'{vs:.2f}x' if vs else '-'):>15}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: cuda when a GPU is visible")
    ap.add_argument("--sizes", help="comma-separated parameter counts, floats allowed "
                    "(default: 10e6,100e6,1e9 on GPU, 10e6,30e6,100e6 on CPU)")
    ap.add_argument("--providers", help="comma-separated subset (default: all for the device)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: bf16 params and grads with fp32 masters (megaft providers)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--json", help="write the rows and the environment to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = [int(float(s)) for s in (args.sizes or ("10e6,100e6,1e9" if cuda
                                                    else "10e6,30e6,100e6")).split(",")]
    wanted = args.providers.split(",") if args.providers else list(
        GPU_PROVIDERS if cuda else CPU_PROVIDERS)
    unknown = set(wanted) - set(GPU_PROVIDERS + CPU_PROVIDERS)
    if unknown:
        ap.error(f"unknown providers {sorted(unknown)}; choose from "
                 f"{', '.join(dict.fromkeys(GPU_PROVIDERS + CPU_PROVIDERS))}")

    env = environment(device)
    print(f"torch {env['torch']}, triton {env['triton']}, device {env['gpu'] or env['cpu']} "
          f"({env['threads']} CPU threads, {env['capability']})")
    providers = []
    for p in wanted:
        why = unavailable(p, device)
        if why:
            print(f"skipping {p}: {why}")
        else:
            validate(p, device, args.dtype)
            providers.append(p)
    print(f"validated {', '.join(providers)} against torch.optim.AdamW(foreach=False): ok")
    print(f"GB/s = {BYTES_PER_PARAM} B/param / time; % copy = share of the bandwidth of a "
          "device copy moving the same bytes (measured in this run); params are whole "
          "1024-wide layers\n")
    rows = run(device, sizes, providers, args.dtype, args.warmup, args.reps)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
