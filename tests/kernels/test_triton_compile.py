"""Every Triton kernel of megaft compiles ahead of time for sm_80 (A100) and sm_90 (H100).

The CPU interpreter the other tests use is lenient about types (loop-carried scalars,
mixed pointer dtypes); the real compiler is not. Compiling needs no GPU, only Triton's
CUDA backend, so CPU-only CI catches what only a GPU run would otherwise reveal. It
runs `python -m benchmarks.triton_aot` in a subprocess because TRITON_INTERPRET (set for
the other kernel tests) turns @triton.jit functions into interpreted ones.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megaft.kernels import _triton

_SCRIPT = """
from benchmarks.triton_aot import main
print("ok" if main(["--arch", "80", "90"]) == 0 else "failed")
"""
# every launch entry point of megaft/kernels/<family>/triton.py (a kernel the discovery missed fails)
KERNELS = {"rmsnorm._fwd_kernel", "rmsnorm._bwd_kernel", "swiglu._fwd_kernel", "swiglu._bwd_kernel",
           "rope._rope_kernel", "cross_entropy._stats_kernel", "cross_entropy._grad_kernel", "linear._gemm_kernel",
           "adamw._adamw_kernel", "grouped_gemm._grouped_rows_kernel", "grouped_gemm._grouped_wgrad_kernel"}


def compile_without_interpreter(script: str, timeout: int) -> str:
    """Run a compile `script` (it prints "ok" last) with the real Triton compiler; its stdout.
    Skips where Triton or its CUDA backend is missing."""
    if _triton.import_error() is not None:
        pytest.skip(reason=f"triton does not import: {_triton.import_error()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/ imports
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout,
                            cwd=root)
    if "No module named 'triton.backends.nvidia'" in result.stderr:
        pytest.skip(reason="this triton has no CUDA backend to compile with")
    assert result.returncode == 0 and result.stdout.rstrip().endswith("ok"), result.stdout + result.stderr[-3000:]
    return result.stdout


def test_every_triton_kernel_compiles_for_sm80_and_sm90():
    stdout = compile_without_interpreter(_SCRIPT, timeout=900)
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] and "." in line.split()[0]]
    compiled = {(r[0], r[1], r[2]) for r in rows if "ok" in r}
    expected = {(k, dtype, arch) for k in KERNELS for dtype in ("bf16", "fp32") for arch in ("sm_80", "sm_90")}
    assert {r[0] for r in rows} == KERNELS, sorted({r[0] for r in rows} ^ KERNELS)
    assert compiled == expected, sorted(expected - compiled)
