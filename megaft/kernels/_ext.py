"""The compiled extensions, each imported once, with the reason when one is missing.

Like apex's ``MultiTensorApply.available/import_err``: a failed import is recorded,
not raised, so pure-torch backends keep working; the original ImportError text is
kept because it names the missing file or symbol. A backend that needs a missing
extension calls :func:`require`, which raises with that text and the fix.
"""

from __future__ import annotations

import importlib
import platform
from dataclasses import dataclass
from types import ModuleType

import torch  # loads libtorch/libc10 before the extensions, which link against them


@dataclass(frozen=True)
class Extension:
    """One compiled extension: the module when it imported, else the import error."""

    name: str
    module: ModuleType | None
    error: str | None

    @property
    def available(self) -> bool:
        return self.module is not None


def _load(name: str) -> Extension:
    try:
        return Extension(name, importlib.import_module(name), None)
    except ImportError as e:  # also covers undefined symbols and ABI mismatches
        return Extension(name, None, f"{type(e).__name__}: {e}")


C = _load("megaft._C")
CUDA = _load("megaft._cuda")


def fix_hint(ext: Extension) -> str:
    """How to get ``ext`` built, given what this environment lacks."""
    rebuild = "pip install --no-build-isolation --no-deps -e ."
    if ext is CUDA and not torch.version.cuda:
        return (f"torch {torch.__version__} has no CUDA; install a CUDA build of torch, "
                f"then rebuild with MEGAFT_CUDA=1 {rebuild}")
    if ext is CUDA:
        return f"rebuild with nvcc available: MEGAFT_CUDA=1 {rebuild}"
    return f"rebuild the extension: {rebuild}"


def require(ext: Extension, what: str) -> ModuleType:
    """The extension's module, or a RuntimeError naming ``what`` needed it and why."""
    if ext.module is None:
        raise RuntimeError(f"{what} needs the compiled extension {ext.name}, which is not "
                           f"available ({ext.error}). Fix: {fix_hint(ext)}.")
    return ext.module


def env_report() -> str:
    """Versions and what was built, and why not; paste it into bug reports."""
    cuda = torch.version.cuda or "none (CPU-only build)"
    lines = [
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"torch CUDA {cuda}, GPU available: {torch.cuda.is_available()}",
        f"CPU threads (torch.get_num_threads): {torch.get_num_threads()}",
    ]
    if torch.cuda.is_available():
        lines.append(f"GPU 0: {torch.cuda.get_device_name(0)}")
    for ext in (C, CUDA):
        if ext.available:
            info = getattr(ext.module, "build_info", None)
            lines.append(f"{ext.name}: built" + (f" ({info()})" if info else ""))
        else:
            lines.append(f"{ext.name}: not available: {ext.error}\n  fix: {fix_hint(ext)}")
    return "\n".join(lines)
