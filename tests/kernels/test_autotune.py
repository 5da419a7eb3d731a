"""Measured ``kernels.backend=auto`` (megaft.kernels.autotune) with injected timers,
and the Triton GEMM's autotune tiles.

No GPU here: the decision logic runs on CPU with fake timers (op, backend -> ms) and
real correctness checks (Triton interpreted); the CUDA-event timer itself is only
exercised on a GPU. The tile candidates are compiled for sm_90 in a subprocess (no
GPU needed) and must not spill registers with bf16 operands.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import types

import pytest
import torch
from multirank import spawn

from megaft.config.kernels import OPS, KernelsConfig
from megaft.config.model import ModelConfig
from megaft.kernels import _ext, _triton, autotune, cases
from megaft.kernels.checks import check_kernels
from tests.kernels.test_triton_compile import compile_without_interpreter

CPU = torch.device("cpu")
_WHY = _triton.unavailable_reason(CPU)
needs_triton = pytest.mark.skipif(_WHY is not None, reason=f"triton cannot run here: {_WHY}")
TINY = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=70)


def measured_kernels(kernels, model, **kwargs):
    """The decided KernelsConfig alone (decide_kernels without its summary record)."""
    return autotune.decide_kernels(kernels, model, **kwargs)[0]


def fake_timer(ms: dict[str, float], calls: list | None = None):
    """Runs fn once (the call must work) and reports the table's time for the backend."""
    def timer(op, backend, fn):
        fn()
        if calls is not None:
            calls.append((op, backend))
        return ms[backend]
    return timer


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_op_case_runs_and_triton_agrees_with_torch(dtype):
    # the representative calls go through the real fronts; the interpreted Triton kernels pass the check
    for op, case in cases.model_cases(TINY, tp=2, batch=2, seq=8).items():
        want = case.step("torch", case.make(CPU, dtype))
        got = case.step("triton", case.make(CPU, dtype))
        assert len(got) == len(want) >= 2, op
        assert autotune.mismatch(got, want, dtype) is None, (op, autotune.mismatch(got, want, dtype))


def test_model_cases_follow_the_model_and_tp():
    big = ModelConfig(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
    shapes = {op: dict(c.shape) for op, c in cases.model_cases(big, tp=4, batch=4, seq=4096).items()}
    assert shapes["rmsnorm"] == {"tokens": 8192, "dim": 4096}  # capped at MAX_TOKENS: batch 4 -> 2
    assert shapes["rope"] == {"batch": 2, "seq": 4096, "heads": 8, "kv_heads": 2, "head_dim": 128}
    assert shapes["swiglu"] == {"tokens": 8192, "ffn": 3584}
    assert shapes["cross_entropy"] == {"tokens": 4096, "vocab": 32064}
    assert shapes["linear"] == {"tokens": 8192, "k": 3584, "n": 4096, "fused_residual": 0,  # tp=4: a separate add
                                "master_weights": 0}
    assert dict(cases.model_cases(big, tp=1, batch=1, seq=64)["linear"].shape)["fused_residual"] == 1
    # optim.master_weights: its own case (bf16 weight and main grad), so its own cache entry
    mw = cases.model_cases(big, tp=4, batch=4, seq=4096, master_weights=True)["linear"]
    assert dict(mw.shape) == dict(shapes["linear"], master_weights=1)
    plain = cases.model_cases(big, tp=4, batch=4, seq=4096)["linear"]
    key = lambda c: autotune.cache_key(c, ["triton"], "H100", torch.bfloat16)  # noqa: E731
    assert key(mw) != key(plain) and json.loads(key(mw))["shape"]["master_weights"] == 1


@needs_triton
@pytest.mark.parametrize("dtype,master_weights", [(torch.float32, False), (torch.bfloat16, False),
                                                  (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16_master_weights"])
def test_linear_case_times_the_wgrad_accumulation_as_training_runs_it(dtype, master_weights, monkeypatch):
    # training: an fp32 weight whose .grad is a view into FlatParams' flat fp32 buffer
    # (optim.master_weights: a bf16 weight and bf16 buffer, a bf16 residual stream),
    # autocast at the run's dtype; the fused backward must add dy.T @ x into that buffer
    from megaft.kernels.linear import triton as tl_linear

    real, into = tl_linear.wgrad_accumulate_, []

    def spy(main_grad, dy, x):
        into.append(main_grad.data_ptr())
        return real(main_grad, dy, x)

    monkeypatch.setattr(tl_linear, "wgrad_accumulate_", spy)
    for fuse_residual in (True, False):
        case = cases.linear_case(13, 24, 20, fuse_residual, master_weights)  # odd sizes: tails in every GEMM dim
        ref = case.make(CPU, dtype)
        param = dtype if master_weights else torch.float32
        assert ref[1].dtype == ref[2].dtype == ref[3].dtype == param
        want = case.step("torch", ref)
        assert into == []  # torch: autograd computes the weight gradient and adds it in place
        assert ref[1].grad.data_ptr() == ref[2].data_ptr() and ref[2].abs().sum() > 0
        inputs = case.make(CPU, dtype)
        weight, main_grad = inputs[1], inputs[2]
        got = case.step("triton", inputs)
        assert into == [main_grad.data_ptr()]  # one accumulation, straight into the flat buffer
        assert weight.grad.data_ptr() == main_grad.data_ptr()  # autograd added zeros, kept the view
        assert got[2].dtype == param and got[1].dtype == dtype
        assert autotune.mismatch(got, want, dtype) is None, autotune.mismatch(got, want, dtype)
        # timed reps accumulate (as micro-batches do): the buffer holds the sum of the calls
        # (bf16 buffer: d + d rounds to exactly 2d, one rounding of an exact doubling)
        first = got[2].clone()
        again = case.step("triton", inputs)
        torch.testing.assert_close(again[2], 2 * first, rtol=1e-5, atol=1e-5)
        into.clear()


@needs_triton
def test_choose_picks_the_fastest_correct_backend():
    case = cases.rmsnorm_case(5, 24)
    calls = []
    fast = autotune.choose(case, ["triton"], device=CPU, dtype=torch.float32,
                           timer=fake_timer({"triton": 0.1, "torch": 0.3}, calls))
    assert (fast.backend, fast.ms, fast.rejected) == ("triton", {"triton": 0.1, "torch": 0.3}, {})
    assert sorted(calls) == [("rmsnorm", "torch"), ("rmsnorm", "triton")]
    slow = autotune.choose(case, ["triton"], device=CPU, dtype=torch.float32,
                           timer=fake_timer({"triton": 0.5, "torch": 0.3}))
    assert slow.backend == "torch"
    tie = autotune.choose(case, ["triton"], device=CPU, dtype=torch.float32,
                          timer=fake_timer({"triton": 0.3, "torch": 0.3}))
    assert tie.backend == "triton"  # a tie keeps the fixed order
    assert fast.describe() == "rmsnorm: triton 0.1 ms, torch 0.3 ms -> triton"


def test_choose_never_picks_a_backend_that_disagrees_or_fails(caplog):
    base = cases.rmsnorm_case(6, 16)

    def step(backend, inputs):
        if backend == "cuda":
            raise RuntimeError("no kernel image for this device")
        out = base.step("torch", inputs)
        return [out[0] * 1.05] + out[1:] if backend == "triton" else out  # triton: a 5% wrong output

    case = cases.Case("rmsnorm", base.shape, base.make, step)
    calls = []
    with caplog.at_level(logging.WARNING, logger="megaft.kernels.autotune"):
        choice = autotune.choose(case, ["triton", "cuda"], device=CPU, dtype=torch.bfloat16,
                                 timer=fake_timer({"triton": 0.01, "cuda": 0.01, "torch": 1.0}, calls))
    assert choice.backend == "torch" and choice.ms == {"torch": 1.0}
    assert calls == [("rmsnorm", "torch")]  # the rejected ones are never timed
    assert choice.rejected["triton"].startswith("output relative error 5.0") and "> 1e-02" in choice.rejected["triton"]
    assert "no kernel image" in choice.rejected["cuda"]
    assert "triton disagrees with torch" in caplog.text and "cuda disagrees with torch" in caplog.text
    assert "triton rejected (output relative error" in choice.describe()


def test_mismatch_tolerances():
    want = [torch.ones(100), torch.ones(3)]
    assert autotune.mismatch([torch.ones(100) * (1 + 5e-5), torch.ones(3)], want, torch.float32) is None
    assert "grad 1" in autotune.mismatch([torch.ones(100), torch.ones(3) * 1.001], want, torch.float32)
    assert autotune.mismatch([torch.ones(100) * 1.005, torch.ones(3)], want, torch.bfloat16) is None
    assert "not finite" in autotune.mismatch([torch.full((100,), float("nan")), torch.ones(3)], want, torch.float32)
    assert "shape" in autotune.mismatch([torch.ones(99), torch.ones(3)], want, torch.float32)


def test_cache_is_written_read_and_invalidated_by_a_version_change(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "kernel_choice.json"
    ops = {"rmsnorm": cases.rmsnorm_case(4, 16), "swiglu": cases.swiglu_case(4, 16)}
    todo = {"rmsnorm": ["cuda"], "swiglu": ["cuda"]}
    # "cuda" here runs torch under another name: the selection logic without a GPU
    for c in list(ops.values()):
        ops[c.op] = cases.Case(c.op, c.shape, c.make, lambda b, x, s=c.step: s("torch", x))
    kw = dict(device=CPU, dtype=torch.float32, cache=autotune.ChoiceCache(path), device_name="Fake GPU")
    calls = []
    first = autotune.measure_ops(ops, todo, timer=fake_timer({"cuda": 0.1, "torch": 0.2}, calls), **kw)
    assert {op: c.backend for op, c in first.items()} == {"rmsnorm": "cuda", "swiglu": "cuda"}
    assert len(calls) == 4 and not any(c.cached for c in first.values())
    stored = json.loads(path.read_text())
    assert len(stored) == 2
    key = json.loads(next(iter(stored)))
    assert key["device"] == "Fake GPU" and key["dtype"] == "float32" and key["versions"]["torch"] == torch.__version__
    assert {v["backend"] for v in stored.values()} == {"cuda"}

    calls.clear()
    again = autotune.measure_ops(ops, todo, timer=fake_timer({"cuda": 9.0, "torch": 0.2}, calls), **kw)
    assert calls == [] and all(c.cached and c.backend == "cuda" for c in again.values())

    real = autotune.versions
    monkeypatch.setattr(autotune, "versions", lambda op: {**real(op), "triton": "99.0"})
    fresh = autotune.measure_ops(ops, todo, timer=fake_timer({"cuda": 9.0, "torch": 0.2}, calls), **kw)
    assert len(calls) == 4 and {c.backend for c in fresh.values()} == {"torch"}
    assert len(json.loads(path.read_text())) == 4  # both version sets kept, under their own keys

    path.write_text("{torn")  # a damaged file is a miss, then rewritten
    assert autotune.ChoiceCache(path).get(next(iter(stored))) is None


def test_a_rebuilt_cuda_extension_misses_the_cache(tmp_path, monkeypatch):
    # the key holds a content hash of the megaft._cuda library that was imported
    so = tmp_path / "_cuda.so"
    so.write_bytes(b"build 1")
    monkeypatch.setattr(_ext, "CUDA", _ext.Extension("megaft._cuda", types.SimpleNamespace(__file__=str(so)), None))
    assert autotune.extension_identity() == hashlib.sha256(b"build 1").hexdigest()[:16]
    assert autotune.versions("rmsnorm")["cuda_extension"] == autotune.extension_identity()
    case = cases.rmsnorm_case(4, 16)
    ops = {"rmsnorm": cases.Case("rmsnorm", case.shape, case.make, lambda b, x: case.step("torch", x))}
    kw = dict(device=CPU, dtype=torch.float32, cache=autotune.ChoiceCache(tmp_path / "c.json"), device_name="Fake GPU")
    calls = []
    timer = fake_timer({"cuda": 0.1, "torch": 0.2}, calls)
    assert autotune.measure_ops(ops, {"rmsnorm": ["cuda"]}, timer=timer, **kw)["rmsnorm"].cached is False
    assert autotune.measure_ops(ops, {"rmsnorm": ["cuda"]}, timer=timer, **kw)["rmsnorm"].cached is True
    assert len(calls) == 2
    so.write_bytes(b"build 2, other kernels")  # rebuilt in place
    assert autotune.extension_identity() == hashlib.sha256(b"build 2, other kernels").hexdigest()[:16]
    assert autotune.measure_ops(ops, {"rmsnorm": ["cuda"]}, timer=timer, **kw)["rmsnorm"].cached is False
    assert len(calls) == 4 and len(json.loads((tmp_path / "c.json").read_text())) == 2
    # not built: None (a later build misses too); megaft._C, always built, hashes its .so
    assert autotune.extension_identity(_ext.Extension("megaft._cuda", None, "ImportError: no module")) is None
    with open(_ext.C.module.__file__, "rb") as f:
        assert autotune.extension_identity(_ext.C) == hashlib.sha256(f.read()).hexdigest()[:16]


def test_default_cache_path(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAFT_CACHE_DIR", str(tmp_path))
    assert autotune.default_cache_path() == tmp_path / "kernel_choice.json"
    monkeypatch.delenv("MEGAFT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert autotune.default_cache_path() == tmp_path / "xdg" / "megaft" / "kernel_choice.json"


def test_only_auto_ops_on_cuda_with_autotune_are_measured():
    cuda = torch.device("cuda")
    assert autotune.ops_to_measure(KernelsConfig(), CPU) == {}  # CPU stays torch
    assert autotune.ops_to_measure(KernelsConfig(autotune=False), cuda) == {}  # the fixed order
    todo = autotune.ops_to_measure(KernelsConfig(rmsnorm="torch", linear="triton"), cuda)
    assert sorted(todo) == ["cross_entropy", "grouped_gemm", "rope", "swiglu"]
    if _triton.import_error() is None:
        assert all("triton" in backends for backends in todo.values())
    fixed = KernelsConfig(autotune=False)
    kw = dict(tp=1, batch=1, seq=8, precision="fp32", device=cuda, timer=fake_timer({}))
    assert measured_kernels(fixed, TINY, **kw) is fixed  # nothing timed, nothing changed


def test_decided_kernels_fill_in_the_auto_ops(monkeypatch, tmp_path):
    monkeypatch.setattr(autotune, "ops_to_measure", lambda kernels, device: {"rmsnorm": ["cuda"], "rope": []})
    seen = []  # model_cases' master_weights: the linear case mirrors optim.master_weights
    monkeypatch.setattr(autotune, "model_cases", lambda *a, **k: (
        seen.append(k["master_weights"]), _torch_as_cuda(cases.model_cases(*a, **k)))[1])
    kernels = KernelsConfig(swiglu="torch", ce_chunk_tokens=7)
    kw = dict(tp=1, batch=1, seq=8, precision="fp32", device=CPU, cache_path=str(tmp_path / "c.json"))
    out, record = autotune.decide_kernels(kernels, TINY, timer=fake_timer({"cuda": 0.1, "torch": 0.2}), **kw)
    assert seen == [False]
    assert (out.rmsnorm, out.rope, out.swiglu, out.ce_chunk_tokens) == ("cuda", "torch", "torch", 7)
    assert kernels.rmsnorm is None  # the run's config is not mutated
    # summary.json's "kernels": every op, what runs it and why
    measured = {"backend": "cuda", "source": "measured", "ms": {"cuda": 0.1, "torch": 0.2}}
    assert record == {"rmsnorm": measured,
                      "rope": {"backend": "torch", "source": "fixed"},  # nothing but torch to time
                      "swiglu": {"backend": "torch", "source": "config"},
                      "cross_entropy": {"backend": "torch", "source": "cpu"},  # auto, not measured: CPU
                      "linear": {"backend": "torch", "source": "cpu"},
                      "grouped_gemm": {"backend": "torch", "source": "cpu"}}
    assert list(record) == list(OPS)
    again, cached = autotune.decide_kernels(kernels, TINY, timer=fake_timer({}), **kw)
    assert again == out and cached["rmsnorm"] == dict(measured, source="cache")  # the measuring run's ms
    assert measured_kernels(kernels, TINY, timer=fake_timer({}), **kw) == out
    seen.clear()
    autotune.decide_kernels(kernels, TINY, timer=fake_timer({"cuda": 0.1, "torch": 0.2}),
                            **dict(kw, precision="bf16"), master_weights=True)
    assert seen == [True]
    # training passes its optim.master_weights (megaft.training.model.choose_kernels)
    from megaft.config import Config
    from megaft.parallel.grid import ParallelGrid
    from megaft.training import model
    from megaft.training.protocols import RunParts

    passed = []
    monkeypatch.setattr(model, "decide_kernels", lambda *a, **k: passed.append(k["master_weights"]) or (None, {}))
    cfg = Config()
    for flag in (False, True):
        cfg.optim.master_weights = flag
        model.choose_kernels(RunParts(cfg, ParallelGrid.single()))
    assert passed == [False, True]


def test_cpu_runs_record_torch_from_cpu():
    kernels = KernelsConfig(linear="triton")
    out, record = autotune.decide_kernels(kernels, TINY, tp=1, batch=1, seq=8, precision="fp32", device=CPU)
    assert out is kernels
    assert record == {op: {"backend": "triton", "source": "config"} if op == "linear" else
                      {"backend": "torch", "source": "cpu"} for op in OPS}


def _torch_as_cuda(op_cases):
    return {op: cases.Case(op, c.shape, c.make, lambda b, x, s=c.step: s("torch", x)) for op, c in op_cases.items()}


def _ranks_agree(rank, world, cache_dir):
    # every rank would measure differently; all must end with rank 0's choice. MonkeyPatch undoes the
    # patches: the rank processes are pooled (tests/multirank.py) and run other tests afterwards.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autotune, "ops_to_measure", lambda kernels, device: {"rmsnorm": ["cuda"], "swiglu": ["cuda"]})
        patch.setattr(autotune, "model_cases", lambda *a, **k: _torch_as_cuda(cases.model_cases(*a, **k)))
        _agree_on_rank0(rank, cache_dir)


def _agree_on_rank0(rank, cache_dir):
    ms = {"cuda": 0.1, "torch": 0.2} if rank == 0 else {"cuda": 0.3, "torch": 0.2}
    out, record = autotune.decide_kernels(KernelsConfig(), TINY, tp=1, batch=1, seq=8, precision="fp32",
                                          device=CPU, rank=rank, timer=fake_timer(ms),
                                          cache_path=os.path.join(cache_dir, f"rank{rank}.json"))
    assert (out.rmsnorm, out.swiglu) == ("cuda", "cuda"), (rank, out)
    # every rank's summary record is rank 0's measurement
    assert record["swiglu"] == {"backend": "cuda", "source": "measured", "ms": {"cuda": 0.1, "torch": 0.2}}, rank
    assert os.path.exists(os.path.join(cache_dir, "rank0.json"))
    assert not os.path.exists(os.path.join(cache_dir, "rank1.json"))  # only rank 0 measures

    def broken(op, backend, fn):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(RuntimeError, match="autotune failed on rank 0: OutOfMemoryError"):  # on every rank
        measured_kernels(KernelsConfig(), TINY, tp=1, batch=1, seq=8, precision="fp32", device=CPU,
                                  rank=rank, timer=broken, cache_path=os.path.join(cache_dir, "fresh.json"))


def test_rank0_decides_for_every_rank(tmp_path):
    spawn(2, _ranks_agree, str(tmp_path))


def test_autotune_cache_validation(tmp_path):
    assert check_kernels(KernelsConfig(autotune_cache=str(tmp_path / "new" / "c.json")), "cpu") == []
    problems = check_kernels(KernelsConfig(autotune_cache=str(tmp_path)), "cpu")
    assert len(problems) == 1 and "is a directory" in problems[0] and "fix:" in problems[0]
    blocker = tmp_path / "file"
    blocker.write_text("")
    problems = check_kernels(KernelsConfig(autotune_cache=str(blocker / "c.json")), "cpu")
    assert len(problems) == 1 and "not writable" in problems[0] and "kernels.autotune=false" in problems[0]
    assert check_kernels(KernelsConfig(autotune=False, autotune_cache=str(tmp_path)), "cpu") == []


def test_gemm_autotune_tiles():
    tl = _triton.load("linear")
    # interpreted: one small config, so CPU tests never time candidates
    assert [len(k.configs) for k in (tl._gemm, tl._gemm_swiglu, tl._gemm_acc)] == ([1, 1, 1] if _triton.interpreting()
                                                                                      else [8, 6, 8])
    assert all(bm * bn <= 128 * 128 for bm, bn, *_ in tl.SWIGLU_TILES)  # two accumulators: smaller tiles
    configs = [tl._config(*t) for t in tl.GEMM_TILES]
    bf16 = tl._fits(configs, {"A": torch.empty(1, dtype=torch.bfloat16)}, SWIGLU=False)
    fp32 = tl._fits(configs, {"A": torch.empty(1, dtype=torch.float32)}, SWIGLU=False)
    assert len(bf16) == len(configs) and 0 < len(fp32) < len(configs)  # fp32 operands: the big stages go


_COMPILE = """
import concurrent.futures, os, re, subprocess, tempfile
import triton, triton.backends.nvidia as nv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megaft.kernels.linear import triton as lt

# Compiled as the JIT specializes them at run time: unit strides are constants, pointers
# and the other strides 16-byte aligned. Forward (x @ w.T, + bias + residual / SwiGLU):
# unit strides along K of x and w.T and along N of out; wgrad (main_grad += dy.T @ x):
# dy.T is column-major, x row-major, main_grad fp32 (the bf16 main grad of
# optim.master_weights keeps the same fp32 accumulator and loads half the bytes of C;
# test_triton_compile.py compiles that variant).
FWD, WGRAD = {"sak", "sbk", "scn", "srn"}, {"sam", "sbn", "scn", "srn"}
VARIANTS = [
    ("gemm", lt.GEMM_TILES, dict(HAS_BIAS=True, HAS_RES=True, SWIGLU=False, ACCUMULATE=False), FWD),
    ("swiglu", lt.SWIGLU_TILES, dict(HAS_BIAS=True, HAS_RES=False, SWIGLU=True, ACCUMULATE=False), FWD),
    ("wgrad", lt.GEMM_TILES, dict(HAS_BIAS=False, HAS_RES=False, SWIGLU=False, ACCUMULATE=True), WGRAD),
]
fn = lt._gemm_kernel
cuobjdump = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")


def signature(variant, unit):
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr or p.name in unit:
            sig[p.name] = "constexpr"
        elif p.name.isupper() and p.name not in ("M", "N", "K"):
            sig[p.name] = "*fp32" if variant == "wgrad" and p.name == "C" else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "i32"
            if p.name.startswith("s"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_tile(job):
    variant, flags, unit, (bm, bn, bk, warps, stages) = job
    sig, attrs = signature(variant, unit)
    consts = dict(flags, IEEE=False, UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **{n: 1 for n in unit})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\\d+) STACK:(\\d+)", usage)
    return f"tile {variant} {bm} {bn} {bk} {warps} {stages} regs {m.group(1)} stack {m.group(2)}"


jobs = [(v, flags, unit, t) for v, tiles, flags, unit in VARIANTS for t in tiles]
with concurrent.futures.ProcessPoolExecutor(2) as pool:  # CI's two cores
    for line in pool.map(compile_tile, jobs):
        print(line, flush=True)
print("ok")
"""


def test_gemm_autotune_tiles_compile_for_h100_without_spills():
    stdout = compile_without_interpreter(_COMPILE, timeout=900)
    rows = [line.split() for line in stdout.splitlines() if line.startswith("tile")]
    print("\n".join(" ".join(r) for r in rows))  # the register table, with -s
    tl = _triton.load("linear")
    assert len(rows) == 2 * len(tl.GEMM_TILES) + len(tl.SWIGLU_TILES)
    spills = [r for r in rows if r[-1] != "0"]
    assert not spills, f"tiles that spill registers to the stack: {spills}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: times the backends with CUDA events")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_measured_auto_on_a_gpu(precision, tmp_path, caplog):
    # real timings: every auto op gets an available backend, the table is logged, the cache
    # answers the second call without timing
    cuda = torch.device("cuda")
    model = ModelConfig(dim=1024, n_heads=8, n_kv_heads=4, ffn_dim=2816, vocab_size=32000)
    todo = autotune.ops_to_measure(KernelsConfig(), cuda)
    kw = dict(tp=1, batch=2, seq=1024, precision=precision, device=cuda, cache_path=str(tmp_path / "c.json"))
    with caplog.at_level(logging.INFO, logger="megaft.kernels.autotune"):
        out = measured_kernels(KernelsConfig(), model, **kw)
    for op, available in todo.items():
        assert getattr(out, op) in available + ["torch"], (op, getattr(out, op))
    assert "rmsnorm: " in caplog.text and " ms" in caplog.text
    assert measured_kernels(KernelsConfig(), model, timer=fake_timer({}), **kw) == out  # from the cache
