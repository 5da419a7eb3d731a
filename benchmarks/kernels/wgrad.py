"""Gradient-accumulation fusion: ``main_grad += dy.T @ x``, per backend.

    python -m benchmarks.kernels.wgrad [--dtype bf16|fp32] [--main-grad fp32|same] [--small] [--reps 50]
                                       [--json out.json]

``--main-grad fp32`` (default) is the fp32 main grad of fp32 params; ``same`` is a
buffer of the operands' dtype, as ``optim.master_weights`` keeps bf16 grads (fp32 sum
plus the upcast buffer, rounded once; torch's unfused path rounds dW, then the add).

Providers: torch (what the unfused layers do: the weight gradient in the compute dtype,
cast to fp32, then added: three kernels and a weight-sized temporary), triton (one GEMM
with the add in its epilogue) and cuda (one cuBLAS GemmEx with beta = 1,
csrc/cuda/wgrad.cu). A separate script, not an op of ``python -m benchmarks.kernels``:
that harness differentiates every op, and this one is an in-place update without autograd.
Each provider is checked against reference.wgrad_accumulate_ (fp32 addmm of upcast
operands) first; rates are TFLOP/s (2·M·N·K) and % of the matmul rate measured in this run.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.kernels import harness
from benchmarks.kernels.providers import triton_reason
from megaft.kernels import dispatch
from megaft.kernels.linear import reference, wgrad_accumulate_


def shapes(small: bool) -> list[tuple[int, int, int]]:
    if small:
        return [(256, 512, 512), (512, 1024, 1024)]  # tokens M, out N, in K
    return [(8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336)]


def _unfused(mg, dy, x):
    return mg.add_((dy.t() @ x).to(mg.dtype))


PROVIDERS = {
    "torch": _unfused,
    "triton": lambda mg, dy, x: wgrad_accumulate_(mg, dy, x, backend="triton"),
    "cuda": lambda mg, dy, x: wgrad_accumulate_(mg, dy, x, backend="cuda"),
}


def _inputs(shape, dtype, device, seed, grad_dtype=torch.float32):
    m, n, k = shape
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, n, generator=gen).to(device, dtype)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    return torch.randn(n, k, generator=gen).to(device, grad_dtype), dy, x


def check(fn, dtype, device, grad_dtype=torch.float32) -> str | None:
    """None when fn agrees with the reference on an odd shape (twice: it accumulates)."""
    mg, dy, x = _inputs((37, 50, 40), dtype, device, 123, grad_dtype)
    want, got = mg.clone(), mg.clone()
    try:
        for _ in range(2):
            reference.wgrad_accumulate_(want, dy, x)
            fn(got, dy, x)
    except Exception as e:  # noqa: BLE001 - reported as skipped
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # torch's unfused path rounds dW to the dtype
    return None if err <= tol else f"relative error {err:.2e} > {tol:.0e} vs the reference"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.wgrad", description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--main-grad", choices=("fp32", "same"), default="fp32",
                    help="the buffer's dtype: fp32, or the operands' (optim.master_weights' bf16 grads)")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (default without a GPU)")
    ap.add_argument("--interpret", action="store_true", help="run Triton interpreted on CPU (correctness only)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="write rows, skipped providers, limits and the environment here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.small or device.type == "cpu"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    grad_dtype = torch.float32 if args.main_grad == "fp32" else dtype
    warmup, reps = (2, 10) if small else (args.warmup, args.reps)
    limits = {"copy_bytes_per_s": harness.copy_bandwidth(device, warmup, reps),
              "matmul_flops": harness.matmul_rate(device, dtype, warmup, reps), "matmul_dtype": str(dtype)}
    limits.update(copy_gbps=limits["copy_bytes_per_s"] / 1e9, matmul_tflops=limits["matmul_flops"] / 1e12)
    reasons = {"triton": triton_reason(device, args.interpret),
               "cuda": dispatch.cuda_unavailable_reason("linear", device)}
    ready, skipped, rows = {}, [], []
    for name, fn in PROVIDERS.items():
        why = reasons.get(name) or check(fn, dtype, device, grad_dtype)
        if why:
            skipped.append(f"wgrad {name}: {why}")
        else:
            ready[name] = fn
    for shape in shapes(small):
        sets = [_inputs(shape, dtype, device, 0, grad_dtype)]
        per_set = sum(t.numel() * t.element_size() for t in sets[0])
        sets += [_inputs(shape, dtype, device, s, grad_dtype)
                 for s in range(1, harness.copies_beyond_l2(per_set, device))]
        base = None
        for name, fn in ready.items():
            calls = [lambda a=a, fn=fn: fn(*a) for a in sets]
            times = harness.time_calls(calls, device, warmup, reps)
            peak = harness.peak_memory(calls[0], device)  # the unfused path's weight-sized temporaries
            name_of = {torch.float32: "fp32", torch.bfloat16: "bf16"}
            row = {"op": "wgrad", "shape": "x".join(map(str, shape)),
                   "dtype": f"{name_of[dtype]}->{name_of[grad_dtype]}",  # operands -> main grad
                   "mode": "fwd", "provider": name, **harness.summary(times),
                   "peak_mb": None if peak is None else peak / 2 ** 20}
            flops = 2 * shape[0] * shape[1] * shape[2]
            row["rate"], row["rate_unit"] = flops / (row["median_ms"] / 1e3) / 1e12, "TFLOP/s"
            row["pct_limit"] = 100 * flops / (row["median_ms"] / 1e3) / limits["matmul_flops"]
            base = row["median_ms"] if name == "torch" else base
            row["vs_torch"] = None if base is None else base / row["median_ms"]
            rows.append(row)
    harness.print_table(rows, skipped, limits)
    if args.json:
        harness.write_json(args.json, rows, skipped, limits, harness.environment(device, ["wgrad", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
