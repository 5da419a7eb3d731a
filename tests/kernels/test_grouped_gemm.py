"""The MoE grouped GEMM: every backend against reference.py (the loop over groups), the
output and both grads, plus the dispatch rules and the autotune case.

Without a GPU the Triton kernels run in Triton's CPU interpreter (tests/kernels/
conftest.py sets TRITON_INTERPRET=1); the cuda backend (torch._grouped_mm) runs through
the dispatch rule on CUDA tensors only, so here its wiring (offsets, transposes, copies,
empty groups) is checked by calling megaft.kernels.grouped_gemm.cuda directly, where
torch's CPU op is aten's per-group loop. The @gpu test runs triton and cuda compiled.

Tolerances (dtype, atol, rtol), weights scaled by K^-1/2 so outputs are O(1):
- fp32: 1e-5 (IEEE fp32 products in every backend; other summation orders only).
- fp16: 2e-3 (one fp16 ulp is 1e-3 relative: one rounding each, at different points).
- bf16: 1e-2 (one bf16 ulp is 2^-8..2^-7; the interpreter truncates its fp32 -> bf16
  casts where torch rounds to nearest even, so outputs differ by up to an ulp).
"""

from __future__ import annotations

import pytest
import torch

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig
from megaft.kernels import _triton, autotune, cases, dispatch
from megaft.kernels.checks import check_kernels
from megaft.kernels.grouped_gemm import cuda, grouped_mm, reference, resolve_backend
from tests.kernels.test_triton_compile import compile_without_interpreter

CPU = torch.device("cpu")
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
# (rows per group, K, M): empty groups, 1-row groups, one group, no rows at all, more rows
# and columns than one interpreted tile (16 x 32, K steps of 16), non-power-of-two K and M
SHAPES = [([3, 0, 17, 1, 20], 37, 23), ([9], 19, 33), ([1, 1, 1], 16, 40), ([0, 0, 0], 24, 8),
          ([20, 0, 13], 40, 70)]
# torch._grouped_mm's rows are 16 bytes: K and M multiples of 8 (bf16) and 4 (fp32)
ALIGNED = [([3, 0, 17, 1, 20], 40, 24), ([9], 16, 32), ([1, 1, 1], 8, 16), ([0, 0, 0], 24, 8)]

_WHY = _triton.unavailable_reason(CPU)
needs_triton = pytest.mark.skipif(_WHY is not None, reason=f"triton cannot run here: {_WHY}")


def _inputs(counts, k, m, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts, dtype=torch.int64)
    n = int(counts.sum())
    x = torch.randn(n, k, generator=gen).to(device, dtype)
    w = (torch.randn(len(counts), m, k, generator=gen) * k ** -0.5).to(device, dtype)
    return x, w, counts, torch.randn(n, m, generator=gen).to(device, dtype)


def _run(fn, x, w, counts, dy):
    xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(xx, ww, counts)
    y.backward(dy)
    return y.detach(), xx.grad, ww.grad


def _check(fn, x, w, counts, dy, tol=None):
    want = _run(reference.grouped_mm, x, w, counts, dy)
    got = _run(fn, x, w, counts, dy)
    atol, rtol = tol or TOL[x.dtype]
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert g is not None and g.dtype == r.dtype and g.shape == r.shape, name
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol, msg=lambda msg: f"{name}: {msg}")
    empty = [i for i, c in enumerate(counts.tolist()) if c == 0]
    assert not got[2][empty].any()  # a group without rows: a zero weight gradient


@needs_triton
@pytest.mark.parametrize("counts,k,m", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(counts, k, m, dtype):
    _check(lambda a, b, c: grouped_mm(a, b, c, "triton"), *_inputs(counts, k, m, dtype))


@pytest.mark.parametrize("counts,k,m", ALIGNED, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_grouped_mm_wiring_matches_reference(counts, k, m, dtype):
    _check(cuda.grouped_mm, *_inputs(counts, k, m, dtype))


def test_torch_backend_is_the_reference():
    x, w, counts, dy = _inputs([3, 0, 5], 7, 6, torch.float32)
    y, dx, dw = _run(lambda a, b, c: grouped_mm(a, b, c, "torch"), x, w, counts, dy)
    want = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(dw[1], torch.zeros(6, 7))
    assert torch.equal(grouped_mm(x, w, counts), reference.grouped_mm(x, w, counts))  # auto on CPU


def test_non_contiguous_operands():
    """x a column slice of a wider activation, w a transposed view: strides, not copies, in
    Triton; the torch._grouped_mm path copies them to the row-major layout it needs."""
    x, w, counts, dy = _inputs([5, 0, 4], 16, 24, torch.float32)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, :16]
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not wide.is_contiguous() and not w_t.is_contiguous()
    fns = [cuda.grouped_mm]
    if _WHY is None:
        fns.append(lambda a, b, c: grouped_mm(a, b, c, "triton"))
    for fn in fns:
        _check(fn, wide, w_t, counts, dy)


@needs_triton
def test_autocast_casts_for_the_compiled_backends():
    x, w, counts, dy = _inputs([4, 0, 3], 16, 8, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _run(reference.grouped_mm, x, w, counts, dy)  # F.linear in bf16
        got = _run(lambda a, b, c: grouped_mm(a, b, c, "triton"), x, w, counts, dy)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32  # fp32 weights get fp32 grads
    for g, r in zip(got, want):
        torch.testing.assert_close(g.float(), r.float(), atol=1e-2, rtol=1e-2)


def test_torch_grouped_mm_refuses_unaligned_rows():
    x, w, counts, _ = _inputs([2, 3], 37, 24, torch.float32)
    with pytest.raises(ValueError, match=r"K=37 multiples of 4 for torch.float32; fix: backend='triton'"):
        cuda.grouped_mm(x, w, counts)
    with pytest.raises(ValueError, match="one dtype"):
        cuda.grouped_mm(x[:, :32].bfloat16(), w[:, :, :32], counts)


def test_inputs_are_checked():
    x, w, counts, _ = _inputs([2, 3], 8, 4, torch.float32)
    with pytest.raises(ValueError, match="sum to x's 5 rows"):
        grouped_mm(x, w, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="must be >= 0"):
        grouped_mm(x, w, torch.tensor([6, -1]))
    with pytest.raises(ValueError, match="integer CPU tensor of the 2 groups"):
        grouped_mm(x, w, torch.tensor([5]))
    with pytest.raises(ValueError, match=r"x \[N, K\] and w \[G, M, K\]"):
        grouped_mm(x, w[:, :, :4], counts)


def test_dispatch(monkeypatch):
    assert resolve_backend("auto", CPU) == "torch"  # the CPU path stays torch, interpreter or not
    x, w, counts, _ = _inputs([2, 3], 8, 4, torch.float32)
    with pytest.raises(ValueError, match="must be one of"):
        grouped_mm(x, w, counts, backend="cutlass")
    # cuda is torch._grouped_mm, refused on CPU tensors with the reason (not megaft._cuda's)
    with pytest.raises(RuntimeError, match=r"grouped_gemm backend 'cuda' is not available: tensors are on cpu "
                                           r"and grouped_gemm's cuda backend, torch._grouped_mm"):
        grouped_mm(x, w, counts, backend="cuda")
    gpu = torch.device("cuda")
    if torch.backends.cuda.is_built():
        assert dispatch.unavailable_reason("grouped_gemm", "cuda", gpu) is None  # no megaft._cuda needed
        monkeypatch.delattr(torch, "_grouped_mm")
        assert "has no torch._grouped_mm" in dispatch.unavailable_reason("grouped_gemm", "cuda", gpu)
    else:
        assert "built without CUDA" in dispatch.unavailable_reason("grouped_gemm", "cuda", gpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="grouped_gemm backend 'triton' is not available.*TRITON_INTERPRET"):
        grouped_mm(x, w, counts, backend="triton")


def test_config():
    assert KernelsConfig().for_op("grouped_gemm") == "auto"
    assert KernelsConfig(backend="cuda").for_op("grouped_gemm") == "cuda"  # torch._grouped_mm is its cuda
    problems = check_kernels(KernelsConfig(grouped_gemm="cuda"), "cpu")
    assert len(problems) == 1 and problems[0].startswith("kernels.grouped_gemm=cuda cannot run grouped_gemm on cpu")
    assert "torch._grouped_mm" in problems[0]


MOE = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=70, n_experts=4, top_k=2, moe_ffn_dim=24)


def test_autotune_case_only_for_a_mixture_of_experts():
    dense = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=70)
    assert "grouped_gemm" not in cases.model_cases(dense, tp=1, batch=1, seq=8)
    case = cases.model_cases(MOE, tp=2, batch=2, seq=8)["grouped_gemm"]
    assert dict(case.shape) == {"rows": 32, "k": 32, "m": 12, "experts": 4}
    x, w, counts, dy = case.make(CPU, torch.float32)
    assert int(counts.sum()) == 32 and counts.dtype == torch.int64 and len(set(counts.tolist())) > 1  # uneven
    # an op the model never calls (a dense model's grouped_gemm) is not measured
    chosen = autotune.measure_ops({}, {"grouped_gemm": ["triton"]}, device=CPU, dtype=torch.float32,
                                  timer=None, cache=None, device_name="cpu")
    assert chosen == {}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_autotune_case_triton_agrees_with_torch(dtype):
    case = cases.model_cases(MOE, tp=2, batch=1, seq=8)["grouped_gemm"]
    want = case.step("torch", case.make(CPU, dtype))
    got = case.step("triton", case.make(CPU, dtype))
    assert len(got) == len(want) == 3
    assert autotune.mismatch(got, want, dtype) is None, autotune.mismatch(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to run Triton and torch._grouped_mm")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_backends_match_reference_gpu(backend, dtype):
    # OLMoE-like routing at a small width: empty experts, 1-row experts, uneven loads
    counts = [0, 1, 300, 17, 0, 1000, 129, 64]
    tol = (1e-4, 1e-4) if dtype == torch.float32 else None  # longer sums than on CPU: other orders' rounding
    fn = lambda a, b, n: grouped_mm(a, b, n, backend)  # noqa: E731
    _check(fn, *_inputs(counts, 256, 384, dtype, device="cuda"), tol=tol)
    _check(fn, *_inputs([0, 0, 0], 256, 384, dtype, device="cuda"), tol=tol)


_COMPILE = """
import concurrent.futures, os, re, subprocess, tempfile
import triton, triton.backends.nvidia as nv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megaft.kernels.grouped_gemm import triton as gt

# as the JIT specializes them: bf16 operands, 16-byte aligned pointers and strides, unit
# strides constant (x, out and dx row-major; w[g].T read along K; dy.T column-major)
UNIT = {"_grouped_rows_kernel": {"sak", "sbk", "scn"}, "_grouped_wgrad_kernel": {"sdyn", "sxk", "sdwk"}}
cuobjdump = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")


def compile_tile(job):
    name, (bm, bn, bk, warps, stages) = job
    fn, unit = getattr(gt, name), UNIT[name]
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr or p.name in unit:
            sig[p.name] = "constexpr"
        elif p.name.isupper():
            sig[p.name] = "*i64" if p.name == "OFFS" else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "i32"
            if p.name.startswith("s"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    consts = dict(IEEE=False, UPCAST=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **{n: 1 for n in unit})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\\d+) STACK:(\\d+)", usage)
    return f"tile {name} {bm} {bn} {bk} {warps} {stages} regs {m.group(1)} stack {m.group(2)}"


jobs = [(name, t) for name in UNIT for t in gt.TILES]
with concurrent.futures.ProcessPoolExecutor(2) as pool:
    for line in pool.map(compile_tile, jobs):
        print(line, flush=True)
print("ok")
"""


def test_autotune_tiles_compile_for_h100_without_spills():
    stdout = compile_without_interpreter(_COMPILE, timeout=900)
    rows = [line.split() for line in stdout.splitlines() if line.startswith("tile")]
    print("\n".join(" ".join(r) for r in rows))  # the register table, with -s
    assert len(rows) == 2 * len(_triton.load("grouped_gemm").TILES)
    spills = [r for r in rows if r[-1] != "0"]
    assert not spills, f"tiles that spill registers to the stack: {spills}"
