"""The CUDA sources compile with bare nvcc, for A100 (sm_80) and H100 (sm_90).

This runs wherever nvcc is, GPU or not, so a CPU-only CI still catches a broken
kernel. The .cu files include no torch headers (their C ABI is csrc/cuda/megaft_cuda.h),
so nothing but the CUDA toolkit is needed, plus the cuBLAS headers for the files that
include cublas_v2.h (wgrad.cu): from the toolkit or the nvidia-cublas wheel; where
neither has them those files are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
CU_FILES = sorted(CUDA_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def _uses_cublas(source: Path) -> bool:
    return "#include <cublas_v2.h>" in source.read_text()


def _cublas_include() -> Path | None:
    """A dir holding cublas_v2.h: the toolkit's include, else a pip nvidia-cublas wheel's."""
    dirs = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    if NVCC:
        dirs.append(Path(NVCC).resolve().parents[1] / "include")
    dirs.append(Path("/usr/local/cuda/include"))
    for site in sys.path:  # nvidia/cu13/include (CUDA 13 wheels), nvidia/cublas/include (cu12)
        dirs += sorted(Path(site).glob("nvidia/*/include")) if site and Path(site).is_dir() else []
    return next((d for d in dirs if (d / "cublas_v2.h").exists()), None)


def test_there_are_cuda_sources():
    assert CU_FILES, f"no .cu files under {CUDA_DIR}"


@needs_nvcc
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles(source, arch, tmp_path):
    obj = tmp_path / f"{source.stem}_sm{arch}.o"
    extra = []
    if _uses_cublas(source):
        cublas = _cublas_include()
        if cublas is None:
            pytest.skip(reason=f"{source.name} includes cublas_v2.h and no cuBLAS headers were found (CUDA "
                        "toolkit include dir, or pip install nvidia-cublas)")
        extra = [f"-I{cublas}"]
    cmd = [NVCC, "-c", "-std=c++17", "-O3", f"-I{CUDA_DIR}", *extra,
           f"-gencode=arch=compute_{arch},code=sm_{arch}", str(source), "-o", str(obj)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    assert obj.stat().st_size > 0


@needs_nvcc
def test_c_abi_header_is_plain_c(tmp_path):
    # The ABI header must be usable from C (extern "C", no C++ in it). nvcc hands a
    # .c file to the host C compiler with the CUDA include dirs added.
    _compile_as_c(tmp_path / "abi.c", '#include "megaft_cuda.h"\n'
                  "int (*fn)(float*, const float*, float*, float*, int64_t, int64_t, double,"
                  " double, double, double, double, cudaStream_t) = megaft_adamw_fp32;\n"
                  "int (*multi)(int64_t, void* const*, const void* const*, float* const*,"
                  " float* const*, float* const*, const int64_t*, const int64_t*,"
                  " const double*, const double*, double, double, double, int, int,"
                  " cudaStream_t) = megaft_adamw_multi_tensor;\n"
                  "enum megaft_adamw_dtype bf16 = MEGAFT_ADAMW_BF16;\n", "-pedantic")


def _compile_as_c(src, code: str, *warnings: str) -> None:
    """nvcc hands a .c file to the host C compiler (C11, warnings as errors) with the CUDA include dirs."""
    src.write_text(code)
    cmd = [NVCC, "-c", f"-I{CUDA_DIR}", "-Xcompiler", ",".join(["-std=c11", "-Wall", "-Werror", *warnings]),
           str(src), "-o", str(src.with_suffix(".o"))]
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
    # csrc/cuda/megaft_kernels.h (RMSNorm, SwiGLU, RoPE, cross-entropy, wgrad) is C too: take
    # each launcher's address (no cuBLAS header needed: the handle is struct cublasContext*).
    _compile_as_c(tmp_path / "kernels_abi.c", '#include "megaft_kernels.h"\n'
                  "void* fns[] = {(void*)megaft_rmsnorm_fwd, (void*)megaft_rmsnorm_bwd,"
                  " (void*)megaft_swiglu_fwd, (void*)megaft_swiglu_bwd, (void*)megaft_rope,"
                  " (void*)megaft_cross_entropy_fwd, (void*)megaft_cross_entropy_bwd,"
                  " (void*)megaft_wgrad_accumulate};\n"
                  "megaft_dtype t = MEGAFT_BF16;\n")


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


def test_kernel_ops_schemas_parse_and_are_implemented():
    """The schema strings of kernel_ops.cpp are only parsed when megaft._cuda is imported
    on a CUDA machine: parse them here with torch's parser, and check that every defined
    op has a CUDA implementation and every implementation a definition."""
    import re

    import torch

    text = (CUDA_DIR / "kernel_ops.cpp").read_text()
    defs = [re.sub(r'"\s*"', "", d) for d in re.findall(r'm\.def\(((?:"[^"]*"\s*)+)\)', text)]
    names = []
    for d in defs:
        schema = torch._C.parse_schema(d.strip('"'))
        names.append(schema.name)
    impls = re.findall(r'm\.impl\("([^"]+)"', text)
    assert names and sorted(names) == sorted(impls), (names, impls)
    assert {"cross_entropy_fwd", "cross_entropy_bwd", "cross_entropy_bwd_", "wgrad_accumulate"} <= set(names)


# A host model of the two cuBLAS calls wgrad.cu makes, per the cuBLAS documentation
# (column-major, op(A) m x k, op(B) k x n, C m x n; lda >= rows of A as stored, ...).
_CUBLAS_MODEL = r"""
#include <cstdint>
#include <cstring>
#include <cublas_v2.h>
static float load(const void* p, cudaDataType t, long i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  uint32_t bits = (uint32_t)static_cast<const uint16_t*>(p)[i] << 16;  // CUDA_R_16BF
  float f; std::memcpy(&f, &bits, 4); return f;
}
extern "C" cublasStatus_t cublasSetStream_v2(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
extern "C" cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
    int k, const void* alpha, const void* A, cudaDataType at, int lda, const void* B, cudaDataType bt, int ldb,
    const void* beta, void* C, cudaDataType ct, int ldc, cublasComputeType_t compute, cublasGemmAlgo_t) {
  if (ct != CUDA_R_32F || compute != CUBLAS_COMPUTE_32F || at != bt || (at != CUDA_R_32F && at != CUDA_R_16BF))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (lda < (ta == CUBLAS_OP_N ? m : k) || ldb < (tb == CUBLAS_OP_N ? k : n) || ldc < m)
    return CUBLAS_STATUS_INVALID_VALUE;
  float* c = static_cast<float*>(C);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      double acc = 0;
      for (int l = 0; l < k; ++l)
        acc += (double)load(A, at, ta == CUBLAS_OP_N ? i + (long)l * lda : l + (long)i * lda) *
               load(B, bt, tb == CUBLAS_OP_N ? l + (long)j * ldb : j + (long)l * ldb);
      c[i + (long)j * ldc] = *(const float*)alpha * (float)acc + *(const float*)beta * c[i + (long)j * ldc];
    }
  return CUBLAS_STATUS_SUCCESS;
}
"""

_WGRAD_DRIVER = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
#include "megaft_kernels.h"
static uint16_t bf16(float f) { uint32_t b; std::memcpy(&b, &f, 4); return (uint16_t)(b >> 16); }
int main() {
  const long M = 7, N = 5, K = 3;  // all different: a swapped dimension cannot pass
  std::vector<float> dy(M * N), x(M * K), g(N * K), want(N * K);
  std::vector<uint16_t> dyh(M * N), xh(M * K);
  for (long i = 0; i < M * N; ++i) { dy[i] = (float)((i * 7) % 11) - 5; dyh[i] = bf16(dy[i]); }
  for (long i = 0; i < M * K; ++i) { x[i] = (float)((i * 5) % 9) / 4 - 1; xh[i] = bf16(x[i]); }
  for (long i = 0; i < N * K; ++i) g[i] = (float)i;
  for (long r = 0; r < N; ++r)  // row-major main_grad[r, c] += sum_m dy[m, r] x[m, c], twice
    for (long c = 0; c < K; ++c) {
      double s = 0;
      for (long m = 0; m < M; ++m) s += (double)dy[m * N + r] * x[m * K + c];
      want[r * K + c] = g[r * K + c] + 2 * (float)s;
    }
  cublasContext* handle = reinterpret_cast<cublasContext*>(0x1);
  std::vector<float> g16 = g;
  for (int rep = 0; rep < 2; ++rep) {
    if (megaft_wgrad_accumulate(handle, dy.data(), x.data(), g.data(), M, N, K, MEGAFT_F32, 0) != 0) return 2;
    if (megaft_wgrad_accumulate(handle, dyh.data(), xh.data(), g16.data(), M, N, K, MEGAFT_BF16, 0) != 0) return 3;
  }
  for (long i = 0; i < N * K; ++i)
    if (std::fabs(g[i] - want[i]) > 1e-4f || std::fabs(g16[i] - want[i]) > 1e-4f) {
      std::printf("mismatch at %ld: %f %f want %f\n", i, g[i], g16[i], want[i]);
      return 1;
    }
  if (megaft_wgrad_accumulate(handle, dy.data(), x.data(), g.data(), 1L << 31, N, K, MEGAFT_F32, 0) == 0) return 4;
  std::puts("ok");
  return 0;
}
"""


@needs_nvcc
def test_wgrad_operands_against_a_host_model_of_cublas(tmp_path):
    """wgrad.cu's cublasGemmEx arguments (transposes, m/n/k, leading dims, beta = 1) turn
    row-major main_grad += dy^T @ x into cuBLAS's column-major call: linked here against a
    host implementation of cuBLAS's documented GemmEx contract (no GPU needed) and run."""
    cublas = _cublas_include()
    if cublas is None:
        pytest.skip(reason="no cuBLAS headers (CUDA toolkit include dir, or pip install nvidia-cublas)")
    (tmp_path / "model.cpp").write_text(_CUBLAS_MODEL)
    (tmp_path / "driver.cpp").write_text(_WGRAD_DRIVER)
    exe = tmp_path / "wgrad_check"
    # wgrad.cu has no device code: the host compiler builds it as C++.
    cmd = ["c++", "-std=c++17", "-O1", f"-I{CUDA_DIR}", f"-I{cublas}", f"-I{_cuda_include()}",
           "-x", "c++", str(CUDA_DIR / "wgrad.cu"), "-x", "none", str(tmp_path / "model.cpp"),
           str(tmp_path / "driver.cpp"), "-o", str(exe)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stdout, run.stderr)
