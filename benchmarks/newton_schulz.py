"""Muon's Newton-Schulz iteration (optim.muon.ns_backend) on a 1B model's matrix shapes: each path's
time as a ratio against the torch reference, measured in the same run (issue 41).

    python -m benchmarks.newton_schulz [--device cpu|cuda] [--scale S] [--steps 5] [--reps 3] [--json F]

Shapes: Llama-3.2-1B's (dim 2048, MLP 8192, 8 kv heads of 64: q/o 2048 x 2048, k/v 512 x 2048, gate/up
8192 x 2048, down 2048 x 8192) and a stack of 8 experts 2048 x 2048, each dim divided by --scale (2 on
CPU, where bf16 Newton-Schulz on the whole shapes takes seconds a matrix; 1 on CUDA). Paths:

    torch      megaft.kernels.newton_schulz.reference: torch.optim.Muon's ops, the axpys folded
               into addmm/baddbmm (alpha/beta) - the baseline, ratio 1
    unfolded   the same iteration with each axpy its own op (A @ A then b A + c (A A), ...): what the
               folding the reference already does is worth
    triton     the symmetric products as half-tile Triton GEMMs; timed on CUDA only (on CPU Triton runs
               interpreted, a correctness path, not a speed: shown as "-"); `flops` is its GEMM FLOPs
               over the reference's, (3 m^2 n + m^3) / (4 m^2 n + 2 m^3) for the wide m x n orientation,
               the most it can save at equal GEMM efficiency

The time is the median of --reps calls after one untimed (CUDA: synchronized).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megaft.kernels import _triton
from megaft.kernels.newton_schulz import newton_schulz

COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = {"q_proj": (2048, 2048), "k_proj": (512, 2048), "gate_proj": (8192, 2048), "down_proj": (2048, 8192),
          "experts": (8, 2048, 2048)}


def unfolded(g: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float) -> torch.Tensor:
    """The reference iteration with every axpy a separate op (the form before addmm's folding)."""
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def flops_ratio(shape: tuple) -> float:
    """The triton path's GEMM FLOPs over the reference's (module docstring)."""
    m, n = sorted(shape[-2:])
    return (3 * m * m * n + m ** 3) / (4 * m * m * n + 2 * m ** 3)


def seconds(fn, g: torch.Tensor, steps: int, reps: int) -> float:
    def once() -> float:
        if g.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(g, *COEFFS, steps, 1e-7)
        if g.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(reps))


def paths(device: torch.device) -> dict:
    """{name: fn or None (not timed here)} of the paths on `device`."""
    timed_triton = device.type == "cuda" and _triton.unavailable_reason(device) is None
    return {"torch": lambda *a: newton_schulz(*a, backend="torch"), "unfolded": unfolded,
            "triton": (lambda *a: newton_schulz(*a, backend="triton")) if timed_triton else None}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=int, default=None, help="divide every dim by this (default: 2 on CPU, 1 on CUDA)")
    p.add_argument("--steps", type=int, default=5, help="Newton-Schulz iterations (optim.muon.ns_steps)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    scale = args.scale or (1 if device.type == "cuda" else 2)
    fns = paths(device)
    print(f"Newton-Schulz, {args.steps} steps, bf16, {device.type}"
          f"{' ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}, 1B shapes / {scale}")
    print(f"{'matrix':>10} {'shape':>16} {'torch ms':>9} {'unfolded/torch':>15} {'triton/torch':>13} {'flops':>6}")
    rows, gen = [], torch.Generator().manual_seed(0)
    for name, shape in SHAPES.items():
        shape = shape[:-2] + tuple(d // scale for d in shape[-2:])
        g = torch.randn(*shape, generator=gen).to(device)
        got = {k: None if fn is None else seconds(fn, g, args.steps, args.reps) for k, fn in fns.items()}
        ratio = {k: None if v is None else v / got["torch"] for k, v in got.items()}
        rows.append(dict(matrix=name, shape=list(shape), device=device.type, steps=args.steps,
                         seconds=got, ratio=ratio, triton_flops_ratio=flops_ratio(shape)))
        tri = "-" if ratio["triton"] is None else f"{ratio['triton']:.2f}"
        print(f"{name:>10} {'x'.join(map(str, shape)):>16} {got['torch'] * 1e3:9.1f} {ratio['unfolded']:15.2f} "
              f"{tri:>13} {flops_ratio(shape):6.2f}")
    if fns["triton"] is None:
        print("triton: not timed on this device (Triton compiles for GPUs; on CPU it runs only interpreted); "
              "on a GPU: python -m benchmarks.newton_schulz --device cuda")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
