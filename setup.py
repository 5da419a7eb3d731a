"""Build megaft: the Python package, the Hydra configs and two compiled extensions.

    megaft._C     C++ CPU ops (csrc/cpu/*.cpp), always built
    megaft._cuda  CUDA ops (csrc/cuda/*.cu + the torch bindings csrc/cuda/*.cpp), built when torch has CUDA
                  and nvcc is found; MEGAFT_CUDA=1 forces it (error if impossible),
                  MEGAFT_CUDA=0 skips it

Install without build isolation so the build sees the torch you run with (pip would
otherwise build against a second, throwaway torch):
    pip install --no-build-isolation -e .
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as e:  # typically pip's isolated build environment
    sys.exit(f"megaft's setup.py needs torch to build its extensions ({e}). Install torch "
             "first, then: pip install --no-build-isolation -e .")

ROOT = os.path.dirname(os.path.abspath(__file__))

# -O3 plus: no errno from sqrt (lets GCC vectorize it), no implicit fma contraction
# (the kernels write every fma they want, to match torch's rounding), OpenMP so that
# at::parallel_for actually runs in parallel (ATen's OpenMP backend is a header
# template compiled into the extension). No -march=native: the inner loops carry
# their own ISA clones (see csrc/cpu/adamw.cpp), so the build runs on any x86-64.
CXX_FLAGS = ["-O3", "-g0", "-fno-math-errno", "-ffp-contract=off"]  # -g0: debug info made _C 11 MB
NVCC_FLAGS = ["-O3"]  # never --use_fast_math: it would change sqrt/div rounding


def _sources(*patterns: str) -> list[str]:
    """Sorted paths (relative, as setuptools wants them) matching the patterns."""
    return sorted(p for pat in patterns for p in glob.glob(pat, root_dir=ROOT))


def _openmp_flags() -> list[str]:
    """-fopenmp when the C++ compiler accepts it (GCC/clang with libgomp/libomp)."""
    cxx = os.environ.get("CXX", "c++")
    probe = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    try:
        ok = subprocess.run([cxx, "-fopenmp", "-x", "c++", "-", "-o", os.devnull],
                            input=probe, text=True, capture_output=True).returncode == 0
    except OSError:
        ok = False
    if not ok:
        print("megaft: the C++ compiler lacks OpenMP; megaft._C will run single-threaded")
    return ["-fopenmp"] if ok else []


def _nvcc() -> str | None:
    """Path of nvcc: torch's CUDA_HOME (set only for a CUDA torch), else PATH."""
    if cpp_extension.CUDA_HOME:
        path = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
        return path if os.path.exists(path) else None
    return shutil.which("nvcc")


def _want_cuda() -> bool:
    """Build megaft._cuda? Auto-detect unless MEGAFT_CUDA says 0 or 1."""
    # MEGAFT_BUILD_CUDA is accepted as an alias (the name STYLE.md uses).
    flag = os.environ.get("MEGAFT_CUDA", os.environ.get("MEGAFT_BUILD_CUDA", "")).strip()
    if flag not in ("", "0", "1"):
        sys.exit(f"error: MEGAFT_CUDA must be 0, 1 or unset, got {flag!r}")
    if flag == "0":
        return False
    missing = []
    if not torch.version.cuda:
        missing.append(f"torch {torch.__version__} is a CPU-only build (torch.version.cuda "
                       "is None); install a CUDA build of torch")
    if _nvcc() is None:
        missing.append("nvcc was not found (set CUDA_HOME to the CUDA toolkit or put "
                       "its bin/ on PATH)")
    if flag == "1" and missing:
        sys.exit("error: MEGAFT_CUDA=1 asks for megaft._cuda, but " + "; and ".join(missing)
                 + ". Fix that, or build without it: MEGAFT_CUDA=0.")
    return not missing


def _check_cuda_versions() -> None:
    """apex's guard: nvcc and torch's CUDA must share the major version, or the
    extension links against one runtime and runs against another."""
    out = subprocess.check_output([_nvcc(), "-V"], text=True)
    nvcc_version = re.search(r"release (\d+)\.(\d+)", out).group(1, 2)
    torch_version = torch.version.cuda.split(".")[:2]
    if nvcc_version[0] != torch_version[0]:
        sys.exit(f"error: nvcc is CUDA {'.'.join(nvcc_version)} but torch was built with "
                 f"CUDA {torch.version.cuda}; point CUDA_HOME at a {torch_version[0]}.x "
                 "toolkit or install a matching torch")


def _default_cuda_archs() -> None:
    """With no GPU visible (a login or build node) torch cannot pick the arch:
    compile for A100 and H100 unless TORCH_CUDA_ARCH_LIST says otherwise."""
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"


def _cublas() -> tuple[list[str], list[str]]:
    """(include dirs, link args) for cuBLAS/cuBLASLt, called by wgrad.cu and linear_epilogue.cu.

    CUDAExtension links cudart and torch's own libraries, not cuBLAS. Without an explicit
    link the cuBLAS symbols resolve at import only through libtorch_cuda.so's own
    dependency on libcublas (true of the pip wheels, not of a build with cuBLAS linked in
    statically: pytorch/pytorch#67073), so link them. The toolkit's lib64 has libcublas.so;
    else the nvidia-cublas wheel torch depends on (nvidia/cu13 for CUDA 13, nvidia/cublas
    for 12) ships only libcublas.so.<major>: link that file by name, with an rpath to it.
    The SONAME is the same either way, so at run time the copy torch loaded is the one used."""
    home = cpp_extension.CUDA_HOME or os.path.dirname(os.path.dirname(_nvcc() or "/usr/local/cuda/bin/nvcc"))
    major = torch.version.cuda.split(".")[0]
    for lib in ("lib64", "lib"):
        if os.path.exists(os.path.join(home, lib, "libcublasLt.so")):
            inc = os.path.join(home, "include")
            return [inc] if os.path.exists(os.path.join(inc, "cublasLt.h")) else [], ["-lcublas", "-lcublasLt"]
    for site in sys.path:
        for sub in (f"cu{major}", "cublas"):
            lib = os.path.join(site or ".", "nvidia", sub, "lib")
            if os.path.exists(os.path.join(lib, f"libcublasLt.so.{major}")):
                return [os.path.join(site, "nvidia", sub, "include")], [
                    f"-L{lib}", f"-l:libcublas.so.{major}", f"-l:libcublasLt.so.{major}", f"-Wl,-rpath,{lib}"]
    print(f"megaft: no libcublasLt.so in {home} nor an nvidia-cublas wheel; megaft._cuda relies on "
          "libtorch_cuda.so to bring cuBLAS at import (pip install nvidia-cublas to link it)")
    return [], []


def _extensions() -> list:
    """The table of extensions: (name, sources, condition) rows."""
    with_cuda = _want_cuda()
    rows = [
        ("megaft._C", _sources("csrc/cpu/*.cpp"), True),
        ("megaft._cuda", _sources("csrc/cuda/*.cu", "csrc/cuda/*.cpp"), with_cuda),
    ]
    if with_cuda:
        _check_cuda_versions()
        _default_cuda_archs()
    openmp = _openmp_flags()
    modules = []
    for name, sources, condition in rows:
        if not condition:
            print(f"megaft: not building {name}")
            continue
        cuda = any(s.endswith(".cu") for s in sources)
        make = cpp_extension.CUDAExtension if cuda else cpp_extension.CppExtension
        cublas_inc, cublas_link = _cublas() if cuda else ([], [])
        includes = [os.path.join(ROOT, os.path.dirname(sources[0])), os.path.join(ROOT, "csrc", "include")]
        modules.append(make(
            name, sources, include_dirs=includes + cublas_inc,
            extra_compile_args={"cxx": CXX_FLAGS + openmp, "nvcc": NVCC_FLAGS},
            extra_link_args=openmp + cublas_link))
    return modules


setup(
    name="megaft",
    version="0.1.0",
    description="Slurm-oriented LLM fine-tuning: tensor/pipeline/data parallel, "
                "compiled kernels, Hydra sweeps",
    python_requires=">=3.10",
    # conf/ sits at the top level (Hydra users expect it there) and ships as
    # megaft.conf, so installed code finds its YAML with importlib.resources.
    # hydra_plugins is Hydra's namespace package (no __init__.py): Hydra scans it for
    # the Slurm launcher (`hydra/launcher=slurm`); listed so editable installs map it too.
    packages=find_packages(include=["megaft", "megaft.*"]) + ["megaft.conf", "hydra_plugins",
                                                              "hydra_plugins.megaft_slurm_launcher"],
    package_dir={"megaft.conf": "conf"},
    package_data={"megaft.conf": ["*.yaml", "**/*.yaml"],
                  "megaft.eval": ["tasks/*.yaml", "tasks/*.jsonl", "tasks/*.py"]},  # megaft-eval's example tasks
    # torch is deliberately absent: it is installed first (CPU or CUDA build), and
    # listing it here lets pip replace it with another build.
    install_requires=["numpy", "hydra-core>=1.3", "omegaconf>=2.3", "safetensors",
                      "tokenizers", "tqdm", "submitit", "matplotlib"],
    entry_points={"console_scripts": [
        "megaft-train = megaft.cli:train",
        "megaft-verify = megaft.cli:verify",
        "megaft-report = megaft.report:main",
        "megaft-prepare = megaft.prepare:main",
        "megaft-commbench = megaft.cli:commbench",
        "megaft-plan = megaft.cli:plan",
        "megaft-scale = megaft.cli:scale",
        "megaft-eval = megaft.cli:evaluate",
        "megaft-chat = megaft.cli:chat",
        "megaft-score = megaft.cli:score",
    ]},
    ext_modules=_extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
