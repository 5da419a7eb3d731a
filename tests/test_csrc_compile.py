"""The CUDA sources compile with bare nvcc, for A100 (sm_80) and H100 (sm_90).

This runs wherever nvcc is, GPU or not, so a CPU-only CI still catches a broken
kernel. The .cu files include no torch headers (their C ABI is csrc/cuda/megaft_cuda.h),
so nothing but the CUDA toolkit is needed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
CU_FILES = sorted(CUDA_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def test_there_are_cuda_sources():
    assert CU_FILES, f"no .cu files under {CUDA_DIR}"


@needs_nvcc
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles(source, arch, tmp_path):
    obj = tmp_path / f"{source.stem}_sm{arch}.o"
    cmd = [NVCC, "-c", "-std=c++17", "-O3", f"-I{CUDA_DIR}",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", str(source), "-o", str(obj)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    assert obj.stat().st_size > 0


@needs_nvcc
def test_c_abi_header_is_plain_c(tmp_path):
    # The ABI header must be usable from C (extern "C", no C++ in it). nvcc hands a
    # .c file to the host C compiler with the CUDA include dirs added.
    src = tmp_path / "abi.c"
    src.write_text('#include "megaft_cuda.h"\n'
                   "int (*fn)(float*, const float*, float*, float*, int64_t, int64_t, double,"
                   " double, double, double, double, cudaStream_t) = megaft_adamw_fp32;\n")
    cmd = [NVCC, "-c", f"-I{CUDA_DIR}", "-Xcompiler", "-std=c11,-Wall,-Werror,-pedantic",
           str(src), "-o", str(tmp_path / "abi.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
