"""CPU AdamW step: torch.optim.AdamW (foreach, fused) against megaft._C.

    python -m benchmarks.kernels.adamw_cpu [--sizes 10e6,30e6,100e6] [--reps 15]
                                           [--threads N] [--json out.json]

First validates megaft._C against torch.optim.AdamW (llm.c's rule: no timing of a
wrong kernel), then times one optimizer step per provider: median (p20, p80) over
--reps after --warmup steps, providers taking turns, on torch.get_num_threads()
threads. Every provider
updates one flat fp32 buffer of N elements; torch's optimizers get it as a single
nn.Parameter, their best case (no per-tensor overhead). GB/s counts the minimum
traffic, 28 bytes/param: read p, g, m, v and write p, m, v.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time

import torch

from megaft.kernels import _ext

BYTES_PER_PARAM = 28
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
PROVIDERS = ("torch.foreach", "torch.fused", "megaft._C")


def torch_adamw(param: torch.nn.Parameter, **kind) -> torch.optim.AdamW:
    return torch.optim.AdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                             eps=HP["eps"], weight_decay=HP["weight_decay"], **kind)


def setup(provider: str, n: int):
    """A step function for ``provider`` on fresh N-element tensors."""
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    param.grad = torch.randn(n, generator=gen)
    if provider == "torch.foreach":
        return torch_adamw(param, foreach=True).step
    if provider == "torch.fused":
        return torch_adamw(param, fused=True).step
    op = _ext.require(_ext.C, "benchmark provider megaft._C").adamw_step_
    p, g = param.detach(), param.grad
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    count = [0]

    def step() -> None:
        count[0] += 1
        op(p, g, m, v, count[0], HP["lr"], HP["beta1"], HP["beta2"], HP["eps"],
           HP["weight_decay"])

    return step


def validate(n: int = 1_000_003, steps: int = 3) -> None:
    """megaft._C against torch.optim.AdamW(foreach=False); tolerances as in
    tests/kernels/test_adamw.py (torch's MKL sqrt is up to 1 ulp off)."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    param = torch.nn.Parameter(p0.clone())
    opt = torch_adamw(param, foreach=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    op = _ext.require(_ext.C, "benchmark provider megaft._C").adamw_step_
    for step, g in enumerate(grads, start=1):
        param.grad = g
        opt.step()
        op(p, g, m, v, step, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"],
           HP["weight_decay"])
    state = opt.state[param]
    torch.testing.assert_close(p, param.detach(), rtol=1e-6, atol=1e-6 * HP["lr"])
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-6, atol=1e-7)


def time_interleaved(steps: dict, warmup: int, reps: int) -> dict[str, list[float]]:
    """Milliseconds per step for each provider, taking turns rep by rep so that load
    from other processes on a shared node hits every provider alike (synchronous
    CPU code: a wall clock is exact)."""
    for step in steps.values():
        for _ in range(warmup):  # the first torch step also allocates the state
            step()
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def run(sizes: list[int], warmup: int, reps: int) -> list[dict]:
    rows = []
    for n in sizes:
        # All providers live at once: ~16 bytes/param each plus foreach temporaries.
        times = time_interleaved({p: setup(p, n) for p in PROVIDERS}, warmup, reps)
        gc.collect()
        ms = {p: statistics.median(t) for p, t in times.items()}
        for provider, t in times.items():
            rows.append(dict(kernel="adamw", provider=provider, mode="step", numel=n,
                             dtype="float32", ms_p50=ms[provider], ms_p20=quantile(t, .2),
                             ms_p80=quantile(t, .8),
                             gbps=BYTES_PER_PARAM * n / (ms[provider] * 1e-3) / 1e9,
                             speedup_vs_fused=ms["torch.fused"] / ms[provider],
                             speedup_vs_foreach=ms["torch.foreach"] / ms[provider]))
    return rows


def environment() -> dict:
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
    return dict(torch=torch.__version__, threads=torch.get_num_threads(), cpu=cpu,
                capability=torch.backends.cpu.get_cpu_capability(),
                c_build=_ext.C.module.build_info() if _ext.C.available else None,
                commit=commit, command=" ".join([sys.executable, "-m", __spec__.name]
                                                + sys.argv[1:]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10e6,30e6,100e6",
                    help="comma-separated parameter counts (floats allowed: 1e7)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("--json", help="write the rows and the environment to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(float(s)) for s in args.sizes.split(",")]

    env = environment()
    print(f"torch {env['torch']} ({env['capability']}), {env['threads']} threads, {env['cpu']}")
    print(f"megaft._C: {env['c_build']}")
    validate()
    print("validated megaft._C against torch.optim.AdamW(foreach=False): ok")
    print("each provider steps ONE flat fp32 parameter of N elements; "
          f"GB/s = {BYTES_PER_PARAM} B/param / time; speedup = provider time / this time\n")
    rows = run(sizes, args.warmup, args.reps)
    print(f"{'params':>12} {'provider':<14} {'ms/step':>9} {'GB/s':>7} "
          f"{'vs fused':>9} {'vs foreach':>11}")
    for r in rows:
        print(f"{r['numel']:>12,} {r['provider']:<14} {r['ms_p50']:>9.2f} {r['gbps']:>7.2f} "
              f"{r['speedup_vs_fused']:>8.2f}x {r['speedup_vs_foreach']:>10.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
