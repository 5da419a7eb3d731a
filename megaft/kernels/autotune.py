"""Measured ``kernels.backend=auto``: on a GPU, each op runs the backend that was
fastest on the run's own shapes, among those that agree with torch.

For every op left on ``auto`` (rmsnorm, rope, swiglu, cross_entropy, linear, and
grouped_gemm in a mixture of experts) with
``kernels.autotune=true`` on CUDA, :func:`choose` first runs torch (the reference) and
each available backend once on the op's representative call
(:mod:`megaft.kernels.cases`, fresh inputs per backend) and drops, with a warning, a
backend whose output or gradients differ from torch beyond the dtype's tolerance or
that raises. It then times the rest (CUDA events: warm-up, then the median of timed
reps) and keeps the fastest; ties keep the fixed order triton, cuda, torch. The table
is logged as ``<op>: <backend> <ms> ms, ... -> <fastest>``.

Decisions are cached in a JSON file (``kernels.autotune_cache``, else
``$MEGAFT_CACHE_DIR/kernel_choice.json``, else ``~/.cache/megaft/kernel_choice.json``)
under a key of (device name, torch / triton / CUDA versions, a hash of the op's
Python kernel sources and of the representative calls, a hash of the megaft._cuda shared
library as imported, the backends available, op, dtype, shape): a later run with the same
key skips the timing; any version or source change, or a rebuilt extension, misses and
measures again.

All ranks run the same backends: global rank 0 decides (cache or measurement) and
broadcasts its choices (:func:`decide_kernels`). Per-rank timings would be noisy
enough to split a tp group or pp stages across backends; that is still correct, but
one decision keeps every rank's numerics and speed alike. ``kernels.autotune=false``
keeps the fixed order of megaft.kernels.dispatch (triton, else cuda, else torch), and
CPU runs stay on torch either way. The timing code has been exercised on CPU only
(with injected timers); the CUDA-event timer is unverified on a GPU.

:func:`decide_kernels` also returns what was decided, per op, for the run's
``summary.json`` (key ``kernels``): ``{"backend": ..., "source": ...}`` with source
``measured`` (plus ``ms`` per timed backend and any ``rejected``), ``cache`` (the ms
of the run that measured), ``fixed`` (auto by dispatch's fixed order: autotune off, or
no backend but torch to time), ``config`` (an explicit backend) or ``cpu`` (auto off
CUDA: torch).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from megaft.kernels import _ext, dispatch
from megaft.kernels.cases import Case, model_cases

log = logging.getLogger(__name__)

ORDER = ("triton", "cuda", "torch")  # candidates, and who wins a tie
# Relative error (Frobenius norm of the difference over the reference's) a backend may
# show against torch: fp32 leaves room for other summation orders over long rows/GEMMs,
# half types the usual 1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# (op, backend, fn) -> milliseconds of one fn() call
Timer = Callable[[str, str, Callable[[], object]], float]


@dataclass
class Choice:
    """One op's decision: the backend, each timed backend's ms, the rejected ones' reasons."""
    op: str
    backend: str
    ms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    cached: bool = False

    def record(self) -> dict:
        """The summary.json entry: backend, source (measured / cache / fixed), ms, rejected."""
        out: dict = {"backend": self.backend,
                     "source": "cache" if self.cached else "measured" if self.ms else "fixed"}
        if self.ms:
            out["ms"] = dict(self.ms)
        if self.rejected:
            out["rejected"] = dict(self.rejected)
        return out

    def describe(self) -> str:
        times = ", ".join(f"{b} {t:.3g} ms" for b, t in self.ms.items())
        text = f"{self.op}: {times or 'no timing'} -> {self.backend}"
        for b, why in self.rejected.items():
            text += f"; {b} rejected ({why})"
        return text + (" (cached)" if self.cached else "")


def cuda_event_timer(warmup: int = 3, reps: int = 10) -> Timer:
    """The median of ``reps`` CUDA-event-timed calls after ``warmup`` untimed ones (the
    first calls compile Triton kernels and autotune the GEMM's tiles)."""
    def timer(op: str, backend: str, fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)

    return timer


def mismatch(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> Optional[str]:
    """Why ``got`` (output, grads) disagrees with torch's ``want``, or None."""
    tol = TOLERANCE.get(dtype, 1e-2)
    if len(got) != len(want):
        return f"{len(got)} results, torch gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        name = "output" if i == 0 else f"grad {i}"
        if g.shape != w.shape:
            return f"{name} shape {tuple(g.shape)} != {tuple(w.shape)}"
        g, w = g.float(), w.float()
        if not torch.isfinite(g).all():
            return f"{name} is not finite"
        err = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
        if not err <= tol:
            return f"{name} relative error {err:.2e} > {tol:.0e}"
    return None


def choose(case: Case, candidates: list[str], *, device: torch.device, dtype: torch.dtype,
           timer: Timer) -> Choice:
    """The fastest of ``candidates`` on ``case`` among those that agree with torch."""
    ranked = [b for b in ORDER if b in candidates or b == "torch"]
    want = case.step("torch", case.make(device, dtype))
    choice = Choice(case.op, "torch")
    for backend in ranked:
        if backend != "torch":
            try:
                why = mismatch(case.step(backend, case.make(device, dtype)), want, dtype)
            except Exception as exc:  # a backend that cannot run this shape is not a candidate
                why = f"{type(exc).__name__}: {exc}"
            if why is not None:
                choice.rejected[backend] = why
                log.warning("kernels auto: %s backend %s disagrees with torch and is not used: %s",
                            case.op, backend, why)
                continue
        inputs = case.make(device, dtype)
        choice.ms[backend] = float(timer(case.op, backend, lambda b=backend, x=inputs: case.step(b, x)))
        del inputs
    choice.backend = min(choice.ms, key=lambda b: (choice.ms[b], ranked.index(b)))
    del want
    return choice


def default_cache_path() -> Path:
    root = os.environ.get("MEGAFT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megaft")
    return Path(root) / "kernel_choice.json"


@functools.lru_cache(maxsize=None)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    # keyed by size and mtime too: a rebuild in place is hashed again
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def extension_identity(ext: Optional[_ext.Extension] = None) -> Optional[str]:
    """A content hash of the shared library ``ext`` (default megaft._cuda) was imported
    from; None when it is not built (or not a file). A rebuilt extension has new kernels
    (or new launch parameters) even when no Python source changed."""
    ext = ext if ext is not None else _ext.CUDA
    path = getattr(ext.module, "__file__", None) if ext.available else None
    if not path or not os.path.isfile(path):
        return None
    st = os.stat(path)
    return _file_digest(os.path.realpath(path), st.st_size, st.st_mtime_ns)


def versions(op: str) -> dict[str, Optional[str]]:
    """What a cached decision depends on besides the device and shape."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for src in sorted((here / op).glob("*.py")) + [here / "cases.py"]:  # the kernels and the timed call
        digest.update(src.read_bytes())
    return {"torch": torch.__version__, "triton": triton_version, "cuda": str(torch.version.cuda),
            "sources": digest.hexdigest()[:16], "cuda_extension": extension_identity()}


def cache_key(case: Case, candidates: list[str], device_name: str, dtype: torch.dtype) -> str:
    return json.dumps({"device": device_name, "versions": versions(case.op), "op": case.op,
                       "dtype": str(dtype).removeprefix("torch."), "shape": dict(case.shape),
                       "candidates": sorted(candidates)}, sort_keys=True)


class ChoiceCache:
    """The JSON file of decisions {key: choice}: read at each lookup, rewritten whole on
    each store (under a lock, merged with what other jobs wrote, atomic replace)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # missing or torn: measure again
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> Optional[Choice]:
        entry = self.read().get(key)
        if not isinstance(entry, dict) or entry.get("backend") not in ORDER:
            return None
        return Choice(entry.get("op", ""), entry["backend"], dict(entry.get("ms", {})),
                      dict(entry.get("rejected", {})), cached=True)

    def put(self, key: str, choice: Choice) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock():
            data = self.read()
            data[key] = {"op": choice.op, "backend": choice.backend, "ms": choice.ms, "rejected": choice.rejected}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".kernel_choice.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)

    @contextlib.contextmanager
    def _lock(self):
        import fcntl

        with open(self.path.with_suffix(".lock"), "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield


def measure_ops(cases: dict[str, Case], candidates: dict[str, list[str]], *, device: torch.device,
                dtype: torch.dtype, timer: Timer, cache: Optional[ChoiceCache], device_name: str) -> dict[str, Choice]:
    """A Choice per op of ``candidates`` (op -> available backends besides torch),
    from ``cache`` when it holds the key, else measured and stored."""
    choices = {}
    for op, available in candidates.items():
        case = cases.get(op)
        if case is None:  # an op the model never calls (grouped_gemm of a dense model): left to the fixed order
            continue
        if not [b for b in available if b != "torch"]:
            choices[op] = Choice(op, "torch")
            continue
        key = cache_key(case, available, device_name, dtype)
        choice = cache.get(key) if cache is not None else None
        if choice is None:
            choice = choose(case, available, device=device, dtype=dtype, timer=timer)
            if cache is not None:
                try:
                    cache.put(key, choice)
                except OSError as exc:  # a read-only home must not stop training
                    log.warning("kernels auto: cannot write the choice cache %s: %s", cache.path, exc)
        choice.op = op
        log.info("kernels auto: %s", choice.describe())
        choices[op] = choice
    return choices


def ops_to_measure(kernels, device: torch.device) -> dict[str, list[str]]:
    """op -> its available non-torch backends, for each op the run leaves on auto, when
    autotuning applies (CUDA device, kernels.autotune); empty otherwise."""
    from megaft.config.kernels import OPS

    if device.type != "cuda" or not kernels.autotune:
        return {}
    return {op: [b for b in ORDER[:-1] if dispatch.unavailable_reason(op, b, device) is None]
            for op in OPS if kernels.for_op(op) == "auto"}


def fixed_record(kernels, device: torch.device) -> dict[str, dict]:
    """op -> {"backend", "source"} without measuring: an explicit backend ("config"; an
    unavailable one was reported by validate), else dispatch's fixed order for auto
    ("fixed" on CUDA; "cpu" elsewhere, where auto is torch)."""
    from megaft.config.kernels import OPS

    record = {}
    for op in OPS:
        asked = kernels.for_op(op)
        if asked != "auto":
            record[op] = {"backend": asked, "source": "config"}
        else:
            source = "fixed" if device.type == "cuda" else device.type
            record[op] = {"backend": dispatch.resolve(op, "auto", device), "source": source}
    return record


def decide_kernels(kernels, model, *, tp: int, batch: int, seq: int, precision: str, device: torch.device,
                   rank: int = 0, timer: Optional[Timer] = None, cache_path: Optional[str] = None,
                   master_weights: bool = False):
    """``(kernels, record)``: ``kernels`` (a KernelsConfig) with every auto op set to its
    measured backend, and op -> what runs it and why (module docstring; summary.json).
    ``master_weights`` (optim.master_weights): the linear case's weight and main grad are
    bf16, as in the run (part of the case's shape, so of the cache key).
    Global rank 0 decides and, when torch.distributed is initialized, broadcasts to the
    world (a failure there is raised on every rank rather than leaving them waiting).
    ``kernels`` is returned unchanged when nothing is measured (CPU, autotune off, no auto op)."""
    todo = ops_to_measure(kernels, device)
    record = fixed_record(kernels, device)
    if not todo:
        return kernels, record
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    decided: dict[str, dict] | str = {}
    if rank == 0 or not distributed:
        try:
            path = os.path.expanduser(cache_path or kernels.autotune_cache) or default_cache_path()
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            op_cases = model_cases(model, tp=tp, batch=batch, seq=seq, master_weights=master_weights)
            choices = measure_ops(op_cases, todo, device=device, dtype=DTYPES[precision],
                                  timer=timer or cuda_event_timer(), cache=ChoiceCache(path), device_name=name)
            decided = {op: c.record() for op, c in choices.items()}
        except Exception as exc:
            if not distributed:
                raise
            decided = f"{type(exc).__name__}: {exc}"
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the timing inputs' blocks go back before the model is built
    if distributed:
        box = [decided]
        torch.distributed.broadcast_object_list(box, src=0)
        decided = box[0]
    if isinstance(decided, str):
        raise RuntimeError(f"kernels.autotune failed on rank 0: {decided}; fix: kernels.autotune=false "
                           "or explicit kernels.<op> backends")
    record.update(decided)
    return dataclasses.replace(kernels, **{op: r["backend"] for op, r in decided.items()}), record

