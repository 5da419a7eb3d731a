"""Multi-tensor AdamW (megaft.kernels.adamw.adamw_multi_tensor_): every backend against
torch.optim.AdamW with param groups, on lists of odd-sized tensors, fp32 and bf16.

The spec: torch.optim.AdamW(foreach=False) run on the fp32 masters with
``grad.float()``; a bf16 param then holds its master rounded to nearest even.
Tolerances (as tests/kernels/test_adamw.py explains): exp_avg/exp_avg_sq equal
torch exactly where torch's CPU kernels use fma (AVX2/AVX-512); the master differs
only through torch's MKL sqrt (1 ulp): 8 ulps of the largest magnitude it held, and
1e-6*lr. Under torch's scalar kernels the moments differ by rounding too. Our kernels all
round IEEE-correctly in the same order, so they equal each other bit for bit: Triton
(interpreted on CPU) and CUDA are checked against megaft._C with torch.equal.
"""

from __future__ import annotations

import pytest
import torch

from kernels.test_adamw import assert_close_to_scale
from megaft.kernels import _ext, _triton
from megaft.kernels.adamw import adamw_multi_tensor_, adamw_step_, resolve_backend
from megaft.kernels.adamw.tensor_lists import make_lists

# exact: make test runs these on the pinned CPU code path; native: and on this CPU's own kernels too, where
# torch's vectorized lerp/addcmul use fma and the cpu backend must equal them bitwise (docs/contributing.md)
pytestmark = [pytest.mark.exact, pytest.mark.native]

# Odd sizes, an empty tensor, and one spanning several Triton chunks of 16384 and a
# partial CUDA chunk; kept small because the Triton interpreter is slow.
SIZE_LISTS = [[1], [7, 0, 4099, 33, 1000], [16384 + 5, 3, 2048]]
DTYPES = [  # (param dtype, grad dtype)
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
]
BETAS = [(0.9, 0.999), (0.3, 0.95)]  # 1 - beta1 < 0.5 and >= 0.5: both lerp branches
# Two param groups: tensors alternate between them.
GROUPS = [dict(lr=1e-3, weight_decay=0.1), dict(lr=3e-2, weight_decay=0.0)]
EPS = 1e-8
STEPS = 3
FMA_TORCH = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
CPU_BACKENDS = ["torch", "cpu", "triton"]  # triton: interpreted (tests/kernels/conftest.py)


def make_case(sizes, param_dtype, grad_dtype, seed=0, device="cpu"):
    """Masters, params (masters rounded, or the masters themselves for fp32 without
    separate masters) and per-step grads."""
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[(torch.randn(n, generator=gen) * scale).to(grad_dtype) for n in sizes]
             for scale in (1.0, 0.1, 3.0)[:STEPS]]
    return ([m.to(device) for m in masters],
            [[g.to(device) for g in step] for step in grads])


def group_hparams(n):
    return ([GROUPS[i % 2]["lr"] for i in range(n)],
            [GROUPS[i % 2]["weight_decay"] for i in range(n)])


def run_torch(masters0, grads, betas):
    """torch.optim.AdamW with two param groups on fp32 copies of the masters."""
    params = [torch.nn.Parameter(m.clone()) for m in masters0]
    opt = torch.optim.AdamW([dict(params=params[i::2], **GROUPS[i]) for i in range(2)],
                            betas=betas, eps=EPS, foreach=False)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.float()
        opt.step()
    return ([p.detach() for p in params], [opt.state[p]["exp_avg"] for p in params],
            [opt.state[p]["exp_avg_sq"] for p in params])


def run_ours(backend, masters0, grads, betas, param_dtype, with_masters, **kw):
    """Our step on the lists; returns (params, masters, exp_avgs, exp_avg_sqs)."""
    masters = [m.clone() for m in masters0]
    params = [m.to(param_dtype, copy=True) for m in masters] if with_masters else masters
    m = [torch.zeros_like(x) for x in masters]
    v = [torch.zeros_like(x) for x in masters]
    lrs, wds = group_hparams(len(masters))
    call = kw.pop("call", adamw_multi_tensor_)
    for step, step_grads in enumerate(grads, start=1):
        call(params, step_grads, m, v, step=step, lr=lrs, beta1=betas[0], beta2=betas[1],
             eps=EPS, weight_decay=wds, master_params=masters if with_masters else None,
             backend=backend)
    return params, masters, m, v


def assert_matches_torch(got, expected, with_masters, masters0, grads):
    """Against torch.optim.AdamW, at tests/kernels/test_adamw.py's tolerances: 8 ulps of the
    largest magnitude a master held (its start or end), of the largest gradient exp_avg summed
    and of its square for exp_avg_sq (issue 44: a sum's rounding is relative to its terms)."""
    params, masters, m, v = got
    p_ref, m_ref, v_ref = expected
    lrs, _ = group_hparams(len(masters))
    for i, (a, b) in enumerate(zip(masters, p_ref)):
        assert_close_to_scale(a, b, torch.maximum(masters0[i].abs(), b.abs()), f"master {i}", atol=1e-6 * lrs[i])
        if with_masters:  # the param is its master rounded to nearest even, exactly
            assert torch.equal(params[i], masters[i].to(params[i].dtype)), f"param {i}"
    for name, ours, ref in (("exp_avg", m, m_ref), ("exp_avg_sq", v, v_ref)):
        for i, (a, b) in enumerate(zip(ours, ref)):
            if FMA_TORCH:
                assert torch.equal(a, b), f"{name}[{i}] differs from torch.optim.AdamW"
            else:  # torch's scalar lerp/addcmul round twice where we round once
                biggest = torch.stack([g[i].float() for g in grads]).abs().amax(0)
                scale = biggest if name == "exp_avg" else biggest.square()
                assert_close_to_scale(a, b, torch.maximum(b.abs(), scale), f"{name}[{i}]")


def assert_bitwise(got, expected):
    for name, xs, ys in zip(("param", "master", "exp_avg", "exp_avg_sq"), got, expected):
        for i, (a, b) in enumerate(zip(xs, ys)):
            assert torch.equal(a.cpu(), b.cpu()), f"{name}[{i}]: {(a.cpu() != b.cpu()).sum()} differ"


# Each size list with one or both lerp branches (the interpreter is slow: not all pairs).
CASES = [(SIZE_LISTS[0], BETAS[0]), (SIZE_LISTS[1], BETAS[0]), (SIZE_LISTS[1], BETAS[1]),
         (SIZE_LISTS[2], BETAS[1])]


@pytest.mark.parametrize("param_dtype, grad_dtype", DTYPES)
@pytest.mark.parametrize("sizes, betas", CASES,
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, list) else None)
def test_backends_match_torch_adamw(sizes, param_dtype, grad_dtype, betas):
    masters0, grads = make_case(sizes, param_dtype, grad_dtype, seed=len(sizes))
    expected = run_torch(masters0, grads, betas)
    # fp32 params are tested both as their own masters and with separate masters.
    variants = [True] if param_dtype == torch.bfloat16 else [False, True]
    for with_masters in variants:
        results = {b: run_ours(b, masters0, grads, betas, param_dtype, with_masters)
                   for b in CPU_BACKENDS}
        for backend, got in results.items():
            assert_matches_torch(got, expected, with_masters, masters0, grads)
        assert_bitwise(results["triton"], results["cpu"])


def test_triton_many_chunks_and_single_tensor_front():
    """Small chunks make the interpreter cover many chunks per tensor and tensors
    whose last chunk is partial; adamw_step_(backend="triton") is a list of one."""
    tri = _triton.load("adamw")
    sizes = [300, 64, 1, 129]
    masters0, grads = make_case(sizes, torch.bfloat16, torch.bfloat16, seed=7)

    def small_chunks(params, grads, m, v, *, master_params, backend, **hp):
        lists = make_lists(params, grads, m, v, master_params=master_params, **hp)
        tri.adamw_multi_tensor_(lists, chunk=64, block=32)

    got = run_ours("triton", masters0, grads, BETAS[0], torch.bfloat16, True, call=small_chunks)
    want = run_ours("cpu", masters0, grads, BETAS[0], torch.bfloat16, True)
    assert_bitwise(got, want)

    p0, g = torch.randn(1001), torch.randn(1001)
    outs = {}
    for backend in ("cpu", "triton"):
        p, m, v = p0.clone(), torch.zeros(1001), torch.zeros(1001)
        for step in (1, 2):
            adamw_step_(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=EPS,
                        weight_decay=0.05, backend=backend)
        outs[backend] = (p, m, v)
    assert all(torch.equal(a, b) for a, b in zip(outs["cpu"], outs["triton"]))


def test_per_tensor_steps():
    # Tensors may be at different steps (e.g. one added later): bias corrections differ.
    masters0, grads = make_case([5, 9], torch.float32, torch.float32, seed=3)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=EPS, weight_decay=0.0)
    outs = {}
    for backend in CPU_BACKENDS:
        ps = [m.clone() for m in masters0]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        adamw_multi_tensor_(ps, grads[0], ms, vs, step=[4, 1], backend=backend, **hp)
        outs[backend] = ps
    ref = [m.clone() for m in masters0]
    for p, g, step in zip(ref, grads[0], (4, 1)):
        adamw_step_(p, g, torch.zeros_like(p), torch.zeros_like(p), step=step, backend="torch", **hp)
    for backend, ps in outs.items():
        for a, b in zip(ps, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=backend)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.update(params=[a["params"][0].bfloat16()]), "no master_params"),
    (lambda a: a.update(grads=[]), "grads has 0 tensors"),
    (lambda a: a.update(exp_avgs=[torch.zeros(8, dtype=torch.bfloat16)]), r"exp_avgs\[0\] is torch.bfloat16"),
    (lambda a: a.update(exp_avg_sqs=a["exp_avgs"]), "shares memory"),
    (lambda a: a.update(grads=[torch.ones(16)[::2]]), "not contiguous"),
    (lambda a: a.update(grads=[torch.ones(9)]), "has 9 elements"),
    (lambda a: a.update(lr=[1e-3, 1e-3]), "lr has 2 entries for 1 tensors"),
    (lambda a: a.update(step=0), "step counts from 1"),
])
def test_bad_lists_raise_before_any_update(mutate, match):
    args = dict(params=[torch.zeros(8)], grads=[torch.ones(8)], exp_avgs=[torch.zeros(8)],
                exp_avg_sqs=[torch.zeros(8)], step=1, lr=1e-3)
    mutate(args)
    before = args["params"][0].clone()
    with pytest.raises(ValueError, match=match):
        adamw_multi_tensor_(**args, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.0,
                            backend="torch")
    assert torch.equal(args["params"][0], before)


def test_auto_never_picks_triton_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == ("cpu" if _ext.C.available else "torch")


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="backend 'triton' is not available.*TRITON_INTERPRET"):
        resolve_backend("triton", torch.device("cpu"))


@pytest.mark.skipif(_ext.CUDA.available, reason="megaft._cuda is built here")
def test_explicit_cuda_without_extension_raises():
    p = [torch.zeros(8)]
    with pytest.raises(RuntimeError, match="backend 'cuda' needs the compiled extension megaft._cuda"):
        adamw_multi_tensor_(p, [torch.ones(8)], [torch.zeros(8)], [torch.zeros(8)], step=1,
                            lr=1e-3, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.0,
                            backend="cuda")
    assert torch.equal(p[0], torch.zeros(8))


def test_optim_config_accepts_triton_only_where_it_runs(monkeypatch):
    from megaft.config import Config
    from megaft.config.optim import OptimConfig, check_optim
    from megaft.optim.checks import check_fused
    from megaft.validation import validate

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    errors = check_fused(OptimConfig(fused="triton"), device="cpu")
    assert len(errors) == 1 and "optim.fused=triton" in errors[0] and "fix" in errors[0]
    cfg = Config()  # the run-level validate() reports it before any rank starts
    cfg.optim.fused, cfg.device = "triton", "cpu"
    assert any("optim.fused=triton cannot run" in p for p in validate(cfg, 2))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_fused(OptimConfig(fused="triton"), device="cpu") == check_optim(OptimConfig(fused="triton")) == []
    assert "unknown" in check_optim(OptimConfig(fused="tpu"))[0]


# Compiled ahead of time for an H100 without a GPU (Triton brings its own ptxas): the
# GPU code path the interpreter does not see. A separate process, because this one
# runs Triton interpreted.
_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megaft.kernels.adamw import triton as tr
names = ["PTRS", "SCAL", "CHUNKS", "LERP_SMALL", "P_BF16", "G_BF16", "HAS_MASTER", "ALIGNED",
         "CHUNK", "BLOCK"]
types = ["*i64", "*fp32", "*i64"] + ["constexpr"] * 7
consts = dict(LERP_SMALL=True, P_BF16=True, G_BF16=True, HAS_MASTER=True, ALIGNED=True,
              CHUNK=tr.CHUNK, BLOCK=tr.BLOCK)
src = ASTSource(fn=tr._adamw_kernel, signature=dict(zip(names, types)), constexprs=consts)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=tr.NUM_WARPS, enable_fp_fusion=False))
print(k.asm["ptx"])
"""


def test_triton_kernel_compiles_for_sm90_with_ieee_math():
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env)
    if out.returncode and "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip(reason="triton's ptxas is missing")
    assert out.returncode == 0, out.stderr[-3000:]
    ptx = out.stdout
    # IEEE division and sqrt (what makes the GPU result equal megaft._C), explicit fma,
    # and 16-byte vector loads on the aligned, unmasked path.
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx and "fma.rn.f32" in ptx
    assert "div.full.f32" not in ptx and "sqrt.approx" not in ptx
    assert "ld.global.v4" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("param_dtype, grad_dtype", DTYPES)
def test_gpu_backends_bitwise_equal_cpu(backend, param_dtype, grad_dtype):
    if backend == "cuda":
        assert _ext.CUDA.available, _ext.CUDA.error
    # Sizes past one CUDA struct (24 tensors / 320 chunks of 65536) and misaligned
    # views (scalar path) next to aligned ones (vector path).
    sizes = [65536 * 330 + 3] + [1000 + i for i in range(30)] + [4096, 1, 0]
    masters0, grads = make_case(sizes, param_dtype, grad_dtype, seed=11)
    for with_masters in ([True] if param_dtype == torch.bfloat16 else [False, True]):
        want = run_ours("cpu", masters0, grads, BETAS[1], param_dtype, with_masters)
        got = run_ours(backend, [m.cuda() for m in masters0],
                       [[g.cuda() for g in step] for step in grads], BETAS[1], param_dtype,
                       with_masters)
        assert_bitwise(got, want)
    masters0 = [torch.randn(1001)]
    buf = [torch.empty(1002, device="cuda")[1:] for _ in range(4)]  # 4-byte misaligned
    p, g, m, v = buf
    p.copy_(masters0[0]), g.copy_(torch.ones(1001)), m.zero_(), v.zero_()
    adamw_multi_tensor_([p], [g], [m], [v], step=1, lr=1e-2, beta1=0.9, beta2=0.99, eps=EPS,
                        weight_decay=0.1, backend=backend)
    want = [masters0[0].clone(), torch.ones(1001), torch.zeros(1001), torch.zeros(1001)]
    adamw_step_(want[0], want[1], want[2], want[3], step=1, lr=1e-2, beta1=0.9, beta2=0.99,
                eps=EPS, weight_decay=0.1, backend="cpu")
    assert torch.equal(p.cpu(), want[0]) and torch.equal(v.cpu(), want[3])
