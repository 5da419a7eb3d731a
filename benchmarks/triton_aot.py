"""Compile every Triton kernel of megaft ahead of time for GPU targets, without a GPU.

    python -m benchmarks.triton_aot --arch 80 90

Triton's CUDA backend compiles to PTX and a cubin for any target (it ships ptxas), so a
CPU-only machine finds what only a GPU run would otherwise reveal: the interpreter the
kernel tests use is lenient about types (loop-carried scalars, mixed pointer dtypes),
the real compiler is not. Every launch entry point (`*_kernel` in
megaft/kernels/<family>/triton.py) is compiled for each target and dtype; the command
prints one line per compile and exits 1 when any failed. It must run without
TRITON_INTERPRET (which turns @triton.jit functions into interpreted ones).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

FAMILIES = ("rmsnorm", "swiglu", "rope", "cross_entropy", "linear", "adamw", "grouped_gemm")
# fp32 pointers; other upper-case names are pointers of the tested dtype, lower-case ones scalars
FP32 = {"RSTD", "DW_PART", "M", "S", "T", "LSE", "G", "COS", "SIN", "SCAL"}
INT64 = {"LABELS", "PTRS", "CHUNKS", "OFFS"}
CONSTS = {"BLOCK": 1024, "BLOCK_QH": 32, "BLOCK_KH": 8, "BLOCK_D": 64,
          "HAS_RESIDUAL": True, "HAS_DH": True, "BACKWARD": False, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32,
          "HAS_BIAS": True, "HAS_RES": True, "SWIGLU": True, "ACCUMULATE": True, "UPCAST": False,
          "LERP_SMALL": False, "HAS_MASTER": True, "ALIGNED": True, "CHUNK": 65536}


def entry_points() -> list[tuple[str, str, object]]:
    """(family, name, JITFunction) of every kernel a launcher calls."""
    from triton.runtime.jit import JITFunction

    out = []
    for family in FAMILIES:
        module = importlib.import_module(f"megaft.kernels.{family}.triton")
        out += [(family, name, fn) for name, fn in sorted(vars(module).items())
                if isinstance(fn, JITFunction) and name.endswith("_kernel")]
    return out


def signature(family: str, fn, dtype: str) -> tuple[dict, dict]:
    """(signature, constexprs) of one kernel at `dtype` (bf16 | fp32), as its launcher calls it."""
    sig, consts = {}, {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            if p.name == "IEEE":
                consts[p.name] = dtype == "fp32"
            elif p.name in ("P_BF16", "G_BF16"):  # AdamW's bf16 params / grads
                consts[p.name] = dtype == "bf16"
            else:
                consts[p.name] = CONSTS[p.name]
        elif p.name in INT64:
            sig[p.name] = "*i64"
        elif p.name.isupper() and not (family == "linear" and p.name in ("M", "N", "K")):  # GEMM sizes
            sig[p.name] = "*fp32" if p.name in FP32 else f"*{dtype}"
        else:
            sig[p.name] = "fp32" if p.name == "eps" else "i32"
    return sig, consts


def compile_all(archs: list[int], dtypes=("bf16", "fp32")) -> list[dict]:
    """One row per (kernel, dtype, arch): ok, seconds, cubin bytes or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for family, name, fn in entry_points():
        for dtype in dtypes:
            sig, consts = signature(family, fn, dtype)
            for arch in archs:
                start = time.perf_counter()
                row = {"kernel": f"{family}.{name}", "dtype": dtype, "arch": f"sm_{arch}"}
                try:
                    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                            target=GPUTarget("cuda", arch, 32))
                    row.update(ok=bool(kernel.asm["cubin"]), cubin_bytes=len(kernel.asm["cubin"]))
                except Exception as exc:  # noqa: BLE001 - every failure is a row, the run goes on
                    row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}")
                row["s"] = round(time.perf_counter() - start, 2)
                rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="SM versions, e.g. 80 90")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("triton_aot: unset TRITON_INTERPRET (it replaces the compiler by the interpreter)", file=sys.stderr)
        return 2
    rows = compile_all(args.arch)
    for r in rows:
        result = f"ok ({r['cubin_bytes']} B cubin)" if r["ok"] else f"FAILED {r.get('error', '')}"
        print(f"{r['kernel']:<28} {r['dtype']:<5} {r['arch']:<6} {r['s']:6.2f} s  {result}", flush=True)
    failed = [r for r in rows if not r["ok"]]
    print(f"triton_aot: {len(rows) - len(failed)} of {len(rows)} compiled for sm_{', sm_'.join(map(str, args.arch))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
