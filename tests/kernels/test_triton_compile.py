"""Every Triton kernel of the model's families compiles to an sm_90 (H100) cubin.

The CPU interpreter the other tests use is lenient about types (loop-carried scalars,
mixed pointer dtypes); the real compiler is not. Compiling needs no GPU, only Triton's
CUDA backend, so CPU-only CI catches what only a GPU run would otherwise reveal. It
runs in a subprocess because TRITON_INTERPRET (set for the other kernel tests) turns
@triton.jit functions into interpreted ones.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megaft.kernels import _triton

_SCRIPT = """
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# fp32 pointers; other upper-case names are pointers of the tested dtype, lower-case ones scalars
FP32 = {"RSTD", "DW_PART", "M", "S", "T", "LSE", "G", "COS", "SIN"}
CONSTS = {"BLOCK": 1024, "BLOCK_QH": 32, "BLOCK_KH": 8, "BLOCK_D": 64,
          "HAS_RESIDUAL": True, "HAS_DH": True, "BACKWARD": False, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32,
          "HAS_BIAS": True, "HAS_RES": True, "SWIGLU": True, "ACCUMULATE": True, "UPCAST": False}
KERNELS = [("rmsnorm", "_fwd_kernel"), ("rmsnorm", "_bwd_kernel"), ("swiglu", "_fwd_kernel"),
           ("swiglu", "_bwd_kernel"), ("rope", "_rope_kernel"), ("cross_entropy", "_stats_kernel"),
           ("cross_entropy", "_grad_kernel"), ("linear", "_gemm_kernel")]
for family, name in KERNELS:
    fn = getattr(importlib.import_module(f"megaft.kernels.{family}.triton"), name)
    for dtype in ("bf16", "fp32"):
        sig, consts = {}, {}
        for p in fn.params:
            if p.is_constexpr:
                sig[p.name] = "constexpr"
                consts[p.name] = dtype == "fp32" if p.name == "IEEE" else CONSTS[p.name]
            elif p.name == "LABELS":
                sig[p.name] = "*i64"
            elif p.name.isupper() and not (family == "linear" and p.name in ("M", "N", "K")):  # GEMM sizes
                sig[p.name] = "*fp32" if p.name in FP32 else f"*{dtype}"
            else:
                sig[p.name] = "fp32" if p.name == "eps" else "i32"
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], (family, name)
        print("compiled", family, name, dtype)
print("ok")
"""


def compile_without_interpreter(script: str, timeout: int) -> str:
    """Run a compile `script` (it prints "ok" last) with the real Triton compiler; its stdout.
    Skips where Triton or its CUDA backend is missing."""
    if _triton.import_error() is not None:
        pytest.skip(reason=f"triton does not import: {_triton.import_error()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    if "No module named 'triton.backends.nvidia'" in result.stderr:
        pytest.skip(reason="this triton has no CUDA backend to compile with")
    assert result.returncode == 0 and result.stdout.rstrip().endswith("ok"), result.stdout + result.stderr[-3000:]
    return result.stdout


def test_triton_kernels_compile_for_h100():
    compile_without_interpreter(_SCRIPT, timeout=600)
