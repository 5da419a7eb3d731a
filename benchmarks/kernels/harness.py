"""Timing, reference rates and output of the kernel microbenchmarks (``python -m benchmarks.kernels``).

Timing (Liger/Triton's do_bench recipe, written out): a warm-up, then ``reps`` calls,
each timed alone. GPU: CUDA events around each call, with the inputs rotated over
enough copies that their total size exceeds twice the L2 cache, so every call reads
from HBM as in a model. CPU: wall clock. Rows report the median with p20/p80.

Reference rates measured in the same run: the device's copy bandwidth (a large
device-to-device copy; bytes read + written per second) and its matmul rate
(a square matmul in the benchmark dtype), so each row can say what fraction of the
physical limit a kernel reaches.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs (linear interpolation, as numpy's default)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(times_s: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(times_s), "p20_ms": 1e3 * quantile(times_s, 0.2),
            "p80_ms": 1e3 * quantile(times_s, 0.8)}


def copies_beyond_l2(bytes_per_set: int, device: torch.device) -> int:
    """How many input sets to rotate so that one pass over them exceeds 2x the L2 cache."""
    if device.type != "cuda" or bytes_per_set <= 0:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(64, -(-2 * l2 // bytes_per_set)))


def time_calls(fns: list[Callable[[], object]], device: torch.device, warmup: int, reps: int) -> list[float]:
    """Seconds per call of fns[i % len(fns)] (one closure per rotated input set)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (start, stop) in enumerate(events):
            start.record()
            fns[i % len(fns)]()
            stop.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(stop) / 1e3 for start, stop in events]
    for i in range(reps):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        times.append(time.perf_counter() - t0)
    return times


def peak_memory(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes allocated at the peak of one call beyond what was allocated before it (GPU only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def copy_bandwidth(device: torch.device, warmup: int, reps: int) -> float:
    """Bytes/s of a large device copy (read + write counted), the memory-bound ceiling."""
    n = (1 << 30 if device.type == "cuda" else 64 << 20) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    t = statistics.median(time_calls([lambda: dst.copy_(src)], device, warmup, reps))
    return 2 * src.numel() * 4 / t


def matmul_rate(device: torch.device, dtype: torch.dtype, warmup: int, reps: int) -> float:
    """FLOP/s of a square matmul in ``dtype``, the compute-bound ceiling."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = statistics.median(time_calls([lambda: a @ b], device, warmup, reps))
    return 2 * n ** 3 / t


def environment(device: torch.device, argv: list[str]) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device.type,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "cpu_threads": torch.get_num_threads(), "commit": commit,
           "command": " ".join(["python -m benchmarks.kernels", *argv])}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


COLUMNS = ["op", "shape", "dtype", "mode", "provider", "median_ms", "p20_ms", "p80_ms", "rate", "pct_limit",
           "vs_torch", "peak_mb"]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_table(rows: list[dict], skipped: list[str], limits: dict, out=sys.stdout) -> None:
    """The rows as a fixed-width table; `rate` is GB/s (memory-bound ops) or TFLOP/s."""
    print(f"copy bandwidth {limits['copy_gbps']:.1f} GB/s, matmul {limits['matmul_tflops']:.2f} TFLOP/s "
          f"({limits['matmul_dtype']}), measured in this run", file=out)
    header = ["op", "shape", "dtype", "mode", "provider", "median ms", "p20", "p80", "rate", "% limit",
              "x torch", "peak MB"]
    table = [[_fmt(r[c]) if c not in ("rate",) else f"{_fmt(r['rate'])} {r['rate_unit']}" for c in COLUMNS]
             for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)), file=out)
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)), file=out)
    for s in skipped:
        print(f"skipped: {s}", file=out)


def write_json(path: str, rows: list[dict], skipped: list[str], limits: dict, env: dict) -> None:
    with open(path, "w") as f:
        json.dump({"environment": env, "limits": limits, "rows": rows, "skipped": skipped}, f, indent=1)


def write_csv(out, rows: list[dict]) -> None:
    writer = csv.DictWriter(out, fieldnames=COLUMNS + ["rate_unit"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)


def plot(rows: list[dict], directory: str) -> list[str]:
    """One PNG per op: median time per provider, grouped by shape and mode (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        groups = list(dict.fromkeys(f"{r['shape']} {r['mode']}" for r in mine))
        providers = list(dict.fromkeys(r["provider"] for r in mine))
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
        width = 0.8 / len(providers)
        for j, p in enumerate(providers):
            xs, ys = [], []
            for i, g in enumerate(groups):
                hit = [r for r in mine if r["provider"] == p and f"{r['shape']} {r['mode']}" == g]
                if hit:
                    xs.append(i + j * width)
                    ys.append(hit[0]["median_ms"])
            ax.bar(xs, ys, width, label=p)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=20, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("median ms (lower is better)")
        ax.set_title(f"{op} ({mine[0]['dtype']})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(directory, f"{op}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def load_average() -> str:
    """The 1, 5 and 15-minute load averages ("unknown" where the OS has none): CPU timings are
    only as good as the machine was quiet, so benchmarks print it at their start and end."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"
