"""The CUDA sources compile with bare nvcc, for A100 (sm_80) and H100 (sm_90).

This runs wherever nvcc is, GPU or not, so a CPU-only CI still catches a broken
kernel. The .cu files include no torch headers (their C ABI is csrc/cuda/megaft_cuda.h),
so nothing but the CUDA toolkit is needed.
"""

from __future__ import annotations

import os
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
                   " double, double, double, double, cudaStream_t) = megaft_adamw_fp32;\n"
                   "int (*multi)(int64_t, void* const*, const void* const*, float* const*,"
                   " float* const*, float* const*, const int64_t*, const int64_t*,"
                   " const double*, const double*, double, double, double, int, int,"
                   " cudaStream_t) = megaft_adamw_multi_tensor;\n"
                   "enum megaft_adamw_dtype bf16 = MEGAFT_ADAMW_BF16;\n")
    cmd = [NVCC, "-c", f"-I{CUDA_DIR}", "-Xcompiler", "-std=c11,-Wall,-Werror,-pedantic",
           str(src), "-o", str(tmp_path / "abi.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"


def _cuda_include() -> Path:
    """The toolkit's include dir (nvcc may be a wrapper script outside the toolkit)."""
    homes = [os.environ.get("CUDA_HOME"), Path(NVCC).resolve().parents[1], "/usr/local/cuda"]
    for home in filter(None, homes):
        if (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    pytest.fail(f"no CUDA include dir with cuda_runtime_api.h among {homes}; set CUDA_HOME")


@needs_nvcc
def test_cuda_binding_compiles_against_torch_headers(tmp_path):
    """csrc/cuda/bindings.cpp (the torch side of megaft._cuda) type-checks with the host
    compiler. A CPU build of torch lacks one generated CUDA header; an empty stand-in
    is enough for a syntax and type check (nothing is linked)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cuda_include = _cuda_include()
    root = CUDA_DIR.parent
    cmd = ["c++", "-std=c++20", "-fsyntax-only", f"-I{tmp_path}", *(f"-I{p}" for p in include_paths()),
           f"-I{sysconfig.get_paths()['include']}", f"-I{cuda_include}", f"-I{root / 'include'}",
           f"-I{CUDA_DIR}", "-DTORCH_EXTENSION_NAME=_cuda", str(CUDA_DIR / "bindings.cpp")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"


@needs_nvcc
def test_kernels_abi_header_is_plain_c(tmp_path):
    # csrc/cuda/megaft_kernels.h (RMSNorm, SwiGLU, RoPE) is C too: take each launcher's address.
    src = tmp_path / "kernels_abi.c"
    src.write_text('#include "megaft_kernels.h"\n'
                   "void* fns[] = {(void*)megaft_rmsnorm_fwd, (void*)megaft_rmsnorm_bwd,"
                   " (void*)megaft_swiglu_fwd, (void*)megaft_swiglu_bwd, (void*)megaft_rope};\n"
                   "megaft_dtype t = MEGAFT_BF16;\n")
    cmd = [NVCC, "-c", f"-I{CUDA_DIR}", "-Xcompiler", "-std=c11,-Wall,-Werror",
           str(src), "-o", str(tmp_path / "kernels_abi.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"


@needs_nvcc
def test_kernel_ops_binding_compiles_against_torch_headers(tmp_path):
    """csrc/cuda/kernel_ops.cpp (torch.ops.megaft.{rmsnorm,swiglu,rope}_*) type-checks
    like bindings.cpp does above."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    root = CUDA_DIR.parent
    cmd = ["c++", "-std=c++20", "-fsyntax-only", f"-I{tmp_path}", *(f"-I{p}" for p in include_paths()),
           f"-I{sysconfig.get_paths()['include']}", f"-I{_cuda_include()}", f"-I{root / 'include'}",
           f"-I{CUDA_DIR}", "-DTORCH_EXTENSION_NAME=_cuda", str(CUDA_DIR / "kernel_ops.cpp")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
