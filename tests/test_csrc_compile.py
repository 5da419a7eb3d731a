"""The CUDA sources compile with bare nvcc, for A100 (sm_80) and H100 (sm_90).

This runs wherever nvcc is, GPU or not, so a CPU-only CI still catches a broken
kernel. The .cu files include no torch headers (their C ABI is csrc/cuda/megaft_cuda.h),
so nothing but the CUDA toolkit is needed, plus the cuBLAS headers for the files that
include cublas_v2.h or cublasLt.h (wgrad.cu, linear_epilogue.cu): from the toolkit or the
nvidia-cublas wheel (both headers ship in it); where neither has them those files are
skipped with the reason. The cuBLAS-calling files are also linked against host models of
the cuBLAS calls they make and run, which checks their operand mapping without a GPU, and
against the real cuBLAS libraries with setup.py's link flags (no undefined symbol left).
"""

from __future__ import annotations

import os
import re
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
    text = source.read_text()
    return "#include <cublas_v2.h>" in text or "#include <cublasLt.h>" in text


def _cublas_include() -> Path | None:
    """A dir holding cublas_v2.h and cublasLt.h: the toolkit's include, else a pip nvidia-cublas wheel's."""
    dirs = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    if NVCC:
        dirs.append(Path(NVCC).resolve().parents[1] / "include")
    dirs.append(Path("/usr/local/cuda/include"))
    for site in sys.path:  # nvidia/cu13/include (CUDA 13 wheels), nvidia/cublas/include (cu12)
        dirs += sorted(Path(site).glob("nvidia/*/include")) if site and Path(site).is_dir() else []
    return next((d for d in dirs if (d / "cublas_v2.h").exists() and (d / "cublasLt.h").exists()), None)


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


def _cuda_homes() -> list:
    return [os.environ.get("CUDA_HOME"), Path(NVCC).resolve().parents[1], "/usr/local/cuda"]


def _cuda_include() -> Path:
    """The toolkit's include dir (nvcc may be a wrapper script outside the toolkit)."""
    for home in filter(None, _cuda_homes()):
        if (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    pytest.fail(f"no CUDA include dir with cuda_runtime_api.h among {_cuda_homes()}; set CUDA_HOME")


def _binding_check(tmp: Path) -> list[str]:
    """The command that type-checks csrc/cuda/bindings.cpp against torch's headers (stubs in `tmp`)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    stub = tmp / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    root = CUDA_DIR.parent
    return ["c++", "-std=c++20", "-fsyntax-only", f"-I{tmp}", *(f"-I{p}" for p in include_paths()),
            f"-I{sysconfig.get_paths()['include']}", f"-I{_cuda_include()}", f"-I{root / 'include'}",
            f"-I{CUDA_DIR}", "-DTORCH_EXTENSION_NAME=_cuda", str(CUDA_DIR / "bindings.cpp")]


def _kernel_ops_check(tmp: Path) -> list[str]:
    """The command that type-checks csrc/cuda/kernel_ops.cpp like bindings.cpp, with torch's own
    ATen/cuda/CUDAContextLight.h included where the cuBLAS headers are found (see the test)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    stub = tmp / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    (tmp / "cusparse.h").write_text("#pragma once\ntypedef struct cusparseContext* cusparseHandle_t;\n")
    (tmp / "cusolverDn.h").write_text("#pragma once\ntypedef struct cusolverDnContext* cusolverDnHandle_t;\n")
    cublas = _cublas_include()
    torch_decls = [f"-I{cublas}", "-include", "ATen/cuda/CUDAContextLight.h"] if cublas else []
    root = CUDA_DIR.parent
    return ["c++", "-std=c++20", "-fsyntax-only", f"-I{tmp}", *(f"-I{p}" for p in include_paths()),
            f"-I{sysconfig.get_paths()['include']}", f"-I{_cuda_include()}", f"-I{root / 'include'}",
            f"-I{CUDA_DIR}", "-DTORCH_EXTENSION_NAME=_cuda", *torch_decls, str(CUDA_DIR / "kernel_ops.cpp")]


HEADER_CHECKS = {"test_cuda_binding_compiles_against_torch_headers": _binding_check,
                 "test_kernel_ops_binding_compiles_against_torch_headers": _kernel_ops_check}


@pytest.fixture(scope="module", autouse=True)
def header_checks(request, tmp_path_factory):
    """The two torch-header type checks (~30 s of one core) start as this module begins, in the
    background, so they run beside the nvcc compiles of the tests before them (CI has 2 cores);
    their tests wait for them: {test name: (command, process)}. A check that cannot start here
    (no nvcc, no CUDA include dir) runs in its test as before."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    started = {}
    for name, check in HEADER_CHECKS.items():
        if NVCC and name in selected and any((Path(h) / "include" / "cuda_runtime_api.h").exists()
                                             for h in filter(None, _cuda_homes())):
            cmd = check(tmp_path_factory.mktemp(name[:30]))
            started[name] = cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield started
    for _, proc in started.values():  # a test that never waited (deselected, interrupted)
        proc.kill()
        proc.communicate()


def _header_check(header_checks: dict, name: str, tmp_path: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    """(command, result) of the header check `name`: the background one, else run here."""
    if name in header_checks:
        cmd, proc = header_checks[name]
        stdout, stderr = proc.communicate()
        return cmd, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    cmd = HEADER_CHECKS[name](tmp_path)
    return cmd, subprocess.run(cmd, capture_output=True, text=True)


@needs_nvcc
def test_cuda_binding_compiles_against_torch_headers(tmp_path, header_checks):
    """csrc/cuda/bindings.cpp (the torch side of megaft._cuda) type-checks with the host
    compiler. A CPU build of torch lacks one generated CUDA header; an empty stand-in
    is enough for a syntax and type check (nothing is linked)."""
    cmd, result = _header_check(header_checks, "test_cuda_binding_compiles_against_torch_headers", tmp_path)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"


@needs_nvcc
def test_kernels_abi_header_is_plain_c(tmp_path):
    # csrc/cuda/megaft_kernels.h (RMSNorm, SwiGLU, RoPE, cross-entropy, wgrad, linear) is C too: take
    # each launcher's address (no cuBLAS header needed: the handle is struct cublasContext*).
    _compile_as_c(tmp_path / "kernels_abi.c", '#include "megaft_kernels.h"\n'
                  "void* fns[] = {(void*)megaft_rmsnorm_fwd, (void*)megaft_rmsnorm_bwd,"
                  " (void*)megaft_swiglu_fwd, (void*)megaft_swiglu_bwd, (void*)megaft_rope,"
                  " (void*)megaft_cross_entropy_fwd, (void*)megaft_cross_entropy_bwd,"
                  " (void*)megaft_wgrad_accumulate, (void*)megaft_linear_fwd};\n"
                  "megaft_dtype t = MEGAFT_BF16;\n")


@needs_nvcc
def test_kernel_ops_binding_compiles_against_torch_headers(tmp_path, header_checks):
    """csrc/cuda/kernel_ops.cpp (torch.ops.megaft.*) type-checks like bindings.cpp does above.

    kernel_ops.cpp declares torch's cuBLAS handle/workspace getters itself (to avoid the
    cuSPARSE and cuSOLVER headers). A declaration whose parameters differ from torch's is
    another C++ symbol, missing from libtorch_cuda.so, and megaft._cuda would fail to import
    (seen only on a GPU machine). Where the cuBLAS headers are found, torch's own
    ATen/cuda/CUDAContextLight.h is compiled into the same file (cuSPARSE/cuSOLVER stubbed),
    so such a mismatch is a conflicting redeclaration or an ambiguous call here."""
    cmd, result = _header_check(header_checks, "test_kernel_ops_binding_compiles_against_torch_headers", tmp_path)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
    if not _cublas_include():
        pytest.skip(reason="compiled, but torch's declarations were not checked: no cuBLAS headers "
                    "(CUDA toolkit include dir, or pip install nvidia-cublas)")
    # the check has teeth: the declaration kernel_ops.cpp had before (no `bool setup`) fails it
    bad = tmp_path / "bad.cpp"
    bad.write_text("namespace at::cuda { cublasContext* getCurrentCUDABlasHandle(); }\n"
                   "void* h() { return at::cuda::getCurrentCUDABlasHandle(); }\n")
    result = subprocess.run([*cmd[:-1], str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "ambiguous" in result.stderr, result.stderr[-2000:]


def test_kernel_ops_schemas_parse_and_are_implemented():
    """The schema strings of kernel_ops.cpp are only parsed when megaft._cuda is imported
    on a CUDA machine: parse them here with torch's parser, and check that every defined
    op has a CUDA implementation and every implementation a definition."""
    import torch

    text = (CUDA_DIR / "kernel_ops.cpp").read_text()
    defs = [re.sub(r'"\s*"', "", d) for d in re.findall(r'm\.def\(((?:"[^"]*"\s*)+)\)', text)]
    names = []
    for d in defs:
        schema = torch._C.parse_schema(d.strip('"'))
        names.append(schema.name)
    impls = re.findall(r'm\.impl\("([^"]+)"', text)
    assert names and sorted(names) == sorted(impls), (names, impls)
    assert {"cross_entropy_fwd", "cross_entropy_bwd", "cross_entropy_bwd_", "wgrad_accumulate",
            "linear_fwd"} <= set(names)


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
static void store(void* p, cudaDataType t, long i, float v) {
  if (t == CUDA_R_32F) { static_cast<float*>(p)[i] = v; return; }
  uint32_t b; std::memcpy(&b, &v, 4);  // CUDA_R_16BF: round to nearest even (finite values)
  static_cast<uint16_t*>(p)[i] = (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
extern "C" cublasStatus_t cublasSetStream_v2(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
extern "C" cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
    int k, const void* alpha, const void* A, cudaDataType at, int lda, const void* B, cudaDataType bt, int ldb,
    const void* beta, void* C, cudaDataType ct, int ldc, cublasComputeType_t compute, cublasGemmAlgo_t) {
  // C fp32 with fp32 or bf16 A/B, or C bf16 with bf16 A/B (the 16-bit main grad); fp32 compute
  if ((ct != CUDA_R_32F && ct != at) || compute != CUBLAS_COMPUTE_32F || at != bt ||
      (at != CUDA_R_32F && at != CUDA_R_16BF))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (lda < (ta == CUBLAS_OP_N ? m : k) || ldb < (tb == CUBLAS_OP_N ? k : n) || ldc < m)
    return CUBLAS_STATUS_INVALID_VALUE;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      double acc = 0;
      for (int l = 0; l < k; ++l)
        acc += (double)load(A, at, ta == CUBLAS_OP_N ? i + (long)l * lda : l + (long)i * lda) *
               load(B, bt, tb == CUBLAS_OP_N ? l + (long)j * ldb : j + (long)l * ldb);
      const long ij = i + (long)j * ldc;  // D = alpha AB + beta C in fp32, rounded once to C's type
      store(C, ct, ij, *(const float*)alpha * (float)acc + *(const float*)beta * load(C, ct, ij));
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
static uint16_t bf16_rne(float f) {
  uint32_t b; std::memcpy(&b, &f, 4); return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static float f32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; std::memcpy(&f, &b, 4); return f; }
int main() {
  const long M = 7, N = 5, K = 3;  // all different: a swapped dimension cannot pass
  std::vector<float> dy(M * N), x(M * K), g(N * K), want(N * K), s(N * K);
  std::vector<uint16_t> dyh(M * N), xh(M * K), gb(N * K), want_b(N * K);
  for (long i = 0; i < M * N; ++i) { dy[i] = (float)((i * 7) % 11) - 5; dyh[i] = bf16(dy[i]); }
  for (long i = 0; i < M * K; ++i) { x[i] = (float)((i * 5) % 9) / 4 - 1; xh[i] = bf16(x[i]); }
  // the bf16 main grad starts at values needing all 8 bits, so each add must round (once)
  for (long i = 0; i < N * K; ++i) { g[i] = (float)i; gb[i] = bf16(100.25f + 3 * i); }
  for (long r = 0; r < N; ++r)  // row-major main_grad[r, c] += sum_m dy[m, r] x[m, c], twice
    for (long c = 0; c < K; ++c) {
      double acc = 0;
      for (long m = 0; m < M; ++m) acc += (double)dy[m * N + r] * x[m * K + c];
      s[r * K + c] = (float)acc;
      want[r * K + c] = g[r * K + c] + 2 * (float)acc;
    }
  for (long i = 0; i < N * K; ++i) want_b[i] = bf16_rne(f32(bf16_rne(f32(gb[i]) + s[i])) + s[i]);
  cublasContext* handle = reinterpret_cast<cublasContext*>(0x1);
  std::vector<float> g16 = g;
  for (int rep = 0; rep < 2; ++rep) {
    if (megaft_wgrad_accumulate(handle, dy.data(), x.data(), g.data(), M, N, K, MEGAFT_F32, MEGAFT_F32, 0) != 0)
      return 2;
    if (megaft_wgrad_accumulate(handle, dyh.data(), xh.data(), g16.data(), M, N, K, MEGAFT_BF16, MEGAFT_F32, 0) != 0)
      return 3;
    if (megaft_wgrad_accumulate(handle, dyh.data(), xh.data(), gb.data(), M, N, K, MEGAFT_BF16, MEGAFT_BF16, 0) != 0)
      return 5;
  }
  for (long i = 0; i < N * K; ++i)
    if (std::fabs(g[i] - want[i]) > 1e-4f || std::fabs(g16[i] - want[i]) > 1e-4f || gb[i] != want_b[i]) {
      std::printf("mismatch at %ld: %f %f %f want %f %f\n", i, g[i], g16[i], f32(gb[i]), want[i], f32(want_b[i]));
      return 1;
    }
  if (megaft_wgrad_accumulate(handle, dy.data(), x.data(), g.data(), 1L << 31, N, K, MEGAFT_F32, MEGAFT_F32, 0) == 0)
    return 4;
  // a 16-bit main grad takes only its own operand type (cuBLAS has no fp32 A/B into bf16 C)
  if (megaft_wgrad_accumulate(handle, dy.data(), x.data(), gb.data(), M, N, K, MEGAFT_F32, MEGAFT_BF16, 0) == 0)
    return 6;
  std::puts("ok");
  return 0;
}
"""


@needs_nvcc
def test_wgrad_operands_against_a_host_model_of_cublas(tmp_path):
    """wgrad.cu's cublasGemmEx arguments (transposes, m/n/k, leading dims, beta = 1, C's
    type: fp32, or bf16 rounded once per call) turn row-major main_grad += dy^T @ x into
    cuBLAS's column-major call: linked here against a host implementation of cuBLAS's
    documented GemmEx contract (no GPU needed) and run."""
    _run_on_host_model(tmp_path, "wgrad.cu", _CUBLAS_MODEL, _WGRAD_DRIVER)


def _run_on_host_model(tmp_path, source: str, model: str, driver: str) -> None:
    """Build csrc/cuda/`source` (host code only: the host compiler takes it as C++) with a
    host model of the cuBLAS(Lt) calls it makes and a driver, run it, expect "ok"."""
    cublas = _cublas_include()
    if cublas is None:
        pytest.skip(reason="no cuBLAS headers (CUDA toolkit include dir, or pip install nvidia-cublas)")
    (tmp_path / "model.cpp").write_text(model)
    (tmp_path / "driver.cpp").write_text(driver)
    exe = tmp_path / "check"
    cmd = ["c++", "-std=c++17", "-O1", f"-I{CUDA_DIR}", f"-I{cublas}", f"-I{_cuda_include()}",
           "-x", "c++", str(CUDA_DIR / source), "-x", "none", str(tmp_path / "model.cpp"),
           str(tmp_path / "driver.cpp"), "-o", str(exe)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stdout, run.stderr)


# A host model of the cuBLASLt calls linear_epilogue.cu makes, per the cuBLASLt
# documentation: column-major layouts as stored (before op), D = alpha op(A) op(B) + beta C
# (+ bias over D's rows with CUBLASLT_EPILOGUE_BIAS), attribute sizes as documented, and
# the heuristic's alignment preferences (default 256 bytes) held against the pointers.
_CUBLASLT_MODEL = r"""
#include <cstdint>
#include <cstring>
#include <cublasLt.h>
struct Desc { int32_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N; uint32_t epi = CUBLASLT_EPILOGUE_DEFAULT; const void* bias = nullptr;
              cublasComputeType_t compute; cudaDataType_t scale; };
struct Layout { cudaDataType t; uint64_t rows, cols; int64_t ld; };
struct Pref { uint64_t ws = 0; uint32_t al[4] = {256, 256, 256, 256}; };
static int live = 0;
int model_live() { return live; }
bool model_no_algo = false;
template <class T, class O> static T* as(O p) { return reinterpret_cast<T*>(p); }
static float load(const void* p, cudaDataType t, long i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  uint32_t bits = (uint32_t)static_cast<const uint16_t*>(p)[i] << 16;
  float f; std::memcpy(&f, &bits, 4); return f;
}
static void store(void* p, cudaDataType t, long i, float v) {
  if (t == CUDA_R_32F) { static_cast<float*>(p)[i] = v; return; }
  uint32_t b; std::memcpy(&b, &v, 4); b += 0x7fff + ((b >> 16) & 1);  // round to nearest even
  static_cast<uint16_t*>(p)[i] = (uint16_t)(b >> 16);
}
extern "C" {
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t c, cudaDataType_t s) {
  Desc* x = new Desc; x->compute = c; x->scale = s; *d = as<cublasLtMatmulDescOpaque_t>(x); ++live;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { delete as<Desc>(d); --live; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void* buf,
                                              size_t n) {
  Desc* x = as<Desc>(d);
  if (a == CUBLASLT_MATMUL_DESC_TRANSA && n == 4) std::memcpy(&x->ta, buf, 4);
  else if (a == CUBLASLT_MATMUL_DESC_TRANSB && n == 4) std::memcpy(&x->tb, buf, 4);
  else if (a == CUBLASLT_MATMUL_DESC_EPILOGUE && n == 4) std::memcpy(&x->epi, buf, 4);
  else if (a == CUBLASLT_MATMUL_DESC_BIAS_POINTER && n == sizeof(void*)) std::memcpy(&x->bias, buf, n);
  else return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType t, uint64_t r, uint64_t c, int64_t ld) {
  if (ld < (int64_t)r) return CUBLAS_STATUS_INVALID_VALUE;
  *l = as<cublasLtMatrixLayoutOpaque_t>(new Layout{t, r, c, ld}); ++live;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { delete as<Layout>(l); --live; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = as<cublasLtMatmulPreferenceOpaque_t>(new Pref); ++live; return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) { delete as<Pref>(p); --live; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t a,
                                                    const void* buf, size_t n) {
  Pref* x = as<Pref>(p);
  const cublasLtMatmulPreferenceAttributes_t al[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && n == 8) { std::memcpy(&x->ws, buf, 8); return CUBLAS_STATUS_SUCCESS; }
  for (int i = 0; i < 4; ++i)
    if (a == al[i] && n == 4) { std::memcpy(&x->al[i], buf, 4); return CUBLAS_STATUS_SUCCESS; }
  return CUBLAS_STATUS_INVALID_VALUE;
}
static bool shapes_ok(const Desc* o, const Layout* a, const Layout* b, const Layout* c, const Layout* d) {
  const uint64_t am = o->ta == CUBLAS_OP_N ? a->rows : a->cols, ak = o->ta == CUBLAS_OP_N ? a->cols : a->rows;
  const uint64_t bk = o->tb == CUBLAS_OP_N ? b->rows : b->cols, bn = o->tb == CUBLAS_OP_N ? b->cols : b->rows;
  return am == d->rows && bn == d->cols && ak == bk && c->rows == d->rows && c->cols == d->cols && c->ld == d->ld &&
         a->t == b->t && c->t == d->t && o->compute == CUBLAS_COMPUTE_32F && o->scale == CUDA_R_32F;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t p, int req,
    cublasLtMatmulHeuristicResult_t* out, int* found) {
  if (req < 1 || !shapes_ok(as<Desc>(op), as<Layout>(a), as<Layout>(b), as<Layout>(c), as<Layout>(d)))
    return CUBLAS_STATUS_INVALID_VALUE;
  *found = model_no_algo ? 0 : 1;
  std::memset(out, 0, sizeof(*out));
  std::memcpy(out->algo.data, as<Pref>(p)->al, sizeof(as<Pref>(p)->al));  // the algo remembers its alignment
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t op, const void* alpha, const void* A,
    cublasLtMatrixLayout_t ad, const void* B, cublasLtMatrixLayout_t bd, const void* beta, const void* C,
    cublasLtMatrixLayout_t cd, void* D, cublasLtMatrixLayout_t dd, const cublasLtMatmulAlgo_t* algo, void*, size_t,
    cudaStream_t) {
  const Desc* o = as<Desc>(op);
  const Layout *a = as<Layout>(ad), *b = as<Layout>(bd), *c = as<Layout>(cd), *d = as<Layout>(dd);
  if (!shapes_ok(o, a, b, c, d) || algo == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  uint32_t al[4];
  std::memcpy(al, algo->data, sizeof(al));
  const void* ptrs[4] = {A, B, C, D};
  for (int i = 0; i < 4; ++i)  // a kernel chosen for wider alignment would fault
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % al[i]) return CUBLAS_STATUS_EXECUTION_FAILED;
  if ((o->epi == CUBLASLT_EPILOGUE_BIAS) != (o->bias != nullptr)) return CUBLAS_STATUS_INVALID_VALUE;
  const long k = o->ta == CUBLAS_OP_N ? (long)a->cols : (long)a->rows;
  for (uint64_t j = 0; j < d->cols; ++j)
    for (uint64_t i = 0; i < d->rows; ++i) {
      double acc = 0;
      for (long l = 0; l < k; ++l)
        acc += (double)load(A, a->t, o->ta == CUBLAS_OP_N ? i + l * a->ld : l + i * a->ld) *
               load(B, b->t, o->tb == CUBLAS_OP_N ? l + j * b->ld : j + l * b->ld);
      float v = *(const float*)alpha * (float)acc;
      const float bt = *(const float*)beta;
      if (bt != 0.0f) v += bt * load(C, c->t, i + j * c->ld);
      if (o->bias) v += load(o->bias, d->t, i);
      store(D, d->t, i + j * d->ld, v);
    }
  return CUBLAS_STATUS_SUCCESS;
}
}
"""

_LINEAR_DRIVER = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#include "megaft_kernels.h"
int model_live();
extern bool model_no_algo;
static uint16_t bf16(float f) { uint32_t b; std::memcpy(&b, &f, 4); return (uint16_t)(b >> 16); }  // exact here
static float from_bf16(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; std::memcpy(&f, &b, 4); return f; }
int main() {
  const long M = 7, N = 5, K = 3;  // all different: a swapped dimension cannot pass
  // values whose sums are exact in fp32 and bf16 (quarters, small integers): results compare exactly
  std::vector<float> x(M * K + 1), w(N * K), b(N), r(M * N), y(M * N);
  for (long i = 0; i < M * K + 1; ++i) x[i] = (float)((i * 5) % 9) / 4 - 1;
  for (long i = 0; i < N * K; ++i) w[i] = (float)((i * 7) % 11) - 5;
  for (long i = 0; i < N; ++i) b[i] = (float)(3 * i) - 4;
  for (long i = 0; i < M * N; ++i) r[i] = (float)((i * 3) % 7) - 3;
  auto* h = reinterpret_cast<cublasLtContext*>(0x1);
  for (int offset = 0; offset < 2; ++offset)  // x + 1: a 4-byte aligned view
    for (int with_b = 0; with_b < 2; ++with_b)
      for (int with_r = 0; with_r < 2; ++with_r) {
        const float* xs = x.data() + offset;
        int st = megaft_linear_fwd(h, xs, w.data(), with_b ? b.data() : nullptr, with_r ? r.data() : nullptr,
                                   y.data(), M, N, K, MEGAFT_F32, nullptr, 0, 0);
        if (st != 0) { std::printf("status %d (offset %d bias %d res %d)\n", st, offset, with_b, with_r); return 2; }
        for (long i = 0; i < M; ++i)
          for (long j = 0; j < N; ++j) {  // row-major y[i, j] = sum_l x[i, l] w[j, l] + b[j] + r[i, j]
            float want = 0;
            for (long l = 0; l < K; ++l) want += xs[i * K + l] * w[j * K + l];
            want += (with_b ? b[j] : 0) + (with_r ? r[i * N + j] : 0);
            if (y[i * N + j] != want) { std::printf("f32 mismatch at (%ld, %ld): %f want %f\n", i, j, y[i * N + j], want); return 1; }
          }
      }
  std::vector<uint16_t> xh(M * K), wh(N * K), bh(N), rh(M * N), yh(M * N);
  for (long i = 0; i < M * K; ++i) xh[i] = bf16(x[i]);
  for (long i = 0; i < N * K; ++i) wh[i] = bf16(w[i]);
  for (long i = 0; i < N; ++i) bh[i] = bf16(b[i]);
  for (long i = 0; i < M * N; ++i) rh[i] = bf16(r[i]);
  if (megaft_linear_fwd(h, xh.data(), wh.data(), bh.data(), rh.data(), yh.data(), M, N, K, MEGAFT_BF16, nullptr, 0, 0))
    return 3;
  for (long i = 0; i < M; ++i)
    for (long j = 0; j < N; ++j) {
      float want = b[j] + r[i * N + j];
      for (long l = 0; l < K; ++l) want += x[i * K + l] * w[j * K + l];
      if (from_bf16(yh[i * N + j]) != want) { std::printf("bf16 mismatch at (%ld, %ld)\n", i, j); return 4; }
    }
  if (megaft_linear_fwd(h, x.data(), w.data(), nullptr, nullptr, y.data(), M, N, 0, MEGAFT_F32, nullptr, 0, 0) == 0) return 5;
  if (megaft_linear_fwd(h, x.data(), w.data(), nullptr, nullptr, y.data(), 0, N, K, MEGAFT_F32, nullptr, 0, 0) != 0) return 6;
  model_no_algo = true;  // no algorithm: NOT_SUPPORTED, and the descriptors are still freed
  if (megaft_linear_fwd(h, x.data(), w.data(), b.data(), nullptr, y.data(), M, N, K, MEGAFT_F32, nullptr, 0, 0) !=
      (int)CUBLAS_STATUS_NOT_SUPPORTED) return 7;
  if (model_live() != 0) { std::printf("%d descriptors leaked\n", model_live()); return 8; }
  std::puts("ok");
  return 0;
}
"""


@needs_nvcc
def test_linear_epilogue_against_a_host_model_of_cublaslt(tmp_path):
    """linear_epilogue.cu's cuBLASLt descriptors (transposes, layouts as stored, bias
    epilogue, residual as C with beta = 1, alignment preferences) compute row-major
    y = x @ w.T + bias + residual: linked against a host model of the documented cuBLASLt
    contract and run for fp32 and bf16, with and without bias/residual, on a view that is
    only 4-byte aligned, with k = 0 refused and no descriptor leaked on the error path."""
    _run_on_host_model(tmp_path, "linear_epilogue.cu", _CUBLASLT_MODEL,
                       _LINEAR_DRIVER.replace("CUBLAS_STATUS_NOT_SUPPORTED", "15"))


def _setup_function(name: str, **env):
    """One function of setup.py (which runs setup() on import), compiled alone with `env`."""
    import ast

    tree = ast.parse((CUDA_DIR.parents[1] / "setup.py").read_text())
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in (name, "_nvcc")]
    scope = {"os": os, "sys": sys, "shutil": shutil, **env}
    exec(compile(ast.Module(body=fns, type_ignores=[]), "setup.py", "exec"), scope)
    return scope[name]


@needs_nvcc
def test_setup_links_cublas_for_the_files_that_call_it(tmp_path):
    """setup.py's _cublas() gives megaft._cuda the cuBLAS/cuBLASLt link line (CUDAExtension
    adds none): the cuBLAS-calling sources, built into a shared library with those flags and
    -Wl,--no-undefined, leave no symbol to chance at import; without them they would."""
    import types

    from torch.utils import cpp_extension

    cublas = _cublas_include()
    major = NVCC and re.search(r"release (\d+)", subprocess.run([NVCC, "--version"], capture_output=True,
                                                                  text=True).stdout)
    if cublas is None or not major:
        pytest.skip(reason="no cuBLAS headers (CUDA toolkit include dir, or pip install nvidia-cublas)")
    fake_torch = types.SimpleNamespace(version=types.SimpleNamespace(cuda=f"{major.group(1)}.0"))
    includes, link = _setup_function("_cublas", torch=fake_torch, cpp_extension=cpp_extension)()
    if not link:
        pytest.skip(reason=f"no libcublasLt for CUDA {major.group(1)} in the toolkit or an nvidia-cublas wheel")
    sources = [s for s in CU_FILES if _uses_cublas(s)]
    assert {s.name for s in sources} >= {"wgrad.cu", "linear_epilogue.cu"}
    # these files have no device code: the host compiler builds them
    cmd = ["c++", "-std=c++17", "-shared", "-fPIC", f"-I{CUDA_DIR}", f"-I{cublas}", f"-I{_cuda_include()}",
           *(f"-I{d}" for d in includes), "-x", "c++", *map(str, sources), "-x", "none", "-Wl,--no-undefined",
           "-o", str(tmp_path / "libcheck.so")]
    result = subprocess.run([*cmd, *link], capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd + link)}\n{result.stderr[-4000:]}"
    result = subprocess.run(cmd, capture_output=True, text=True)  # the check has teeth
    assert result.returncode != 0 and "cublasLtMatmul" in result.stderr and "cublasGemmEx" in result.stderr
