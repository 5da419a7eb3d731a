"""Fused-epilogue GEMMs and the weight-gradient accumulation (fp32, and bf16/fp16 main
grads: optim.master_weights) against reference.py, forward and all grads (x, weight,
bias, residual), plus the dispatch rule and the layers' fused path
(megaft.kernels.linear.fused: weight gradient into the fp32 or bf16 .grad, the
two-weight gate/up SwiGLU).

Tolerances (atol, rtol): fp32 1e-5 (IEEE fp32 dot products, other summation order);
bf16 1e-2 relative over the whole tensor (the usual), and no element more than 4
bf16 ulps off: Triton's interpreter truncates fp32 -> bf16 casts where GPUs round to
nearest even (see test_rmsnorm.py), and the SwiGLU epilogue rounds three times
(gate/up, silu, product) where torch's CPU bf16 addmm rounds at other points. Interpreted on
CPU, shapes stay small; the tails (M, N, K not multiples of the tiles) are the point.
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import _triton
from megaft.kernels.linear import layer_linear, linear, linear_swiglu, reference, resolve_backend, wgrad_accumulate_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_WHY = _triton.unavailable_reason(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(_WHY is not None, reason=f"triton cannot run here: {_WHY}")
DTYPES = [pytest.param(torch.float32, (1e-5, 1e-5), id="fp32"), pytest.param(torch.bfloat16, (1e-2, 1e-2), id="bf16")]
SHAPES = [(1, 16, 16), (37, 40, 24), (2, 17, 33, 50)]  # (..., M, K, N): leading dims, tails


def _grads(fn, leaves, dy):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(dy.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def _inputs(shape, dtype, n_out, seed=0):
    *lead, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n_out(n), k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n_out(n), generator=gen).to(DEVICE, dtype)
    return x, w, b, gen


def _close(got, want, tol):
    (out, grads), (ref_out, ref_grads) = got, want
    if out.dtype == torch.bfloat16:
        # elementwise 2 (interpreted: 4) ulps: the reference's CPU bf16 addmm and the
        # epilogue's roundings differ from the kernel's single fp32 epilogue; as a whole
        # the outputs agree to the usual 1e-2
        # Interpreted, each of the SwiGLU epilogue's three bf16 roundings truncates toward
        # zero (up to 1 ulp = 2^-7 relative each, the same sign every time): up to ~2.3%.
        bound = 2.5e-2 if DEVICE == "cpu" else tol[1]
        err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        assert err <= bound, f"output: relative error {err:.2e}"
        ulp = ref_out.float().abs().clamp_min(1.0) * 2.0 ** -7
        assert ((out.float() - ref_out.float()).abs() <= 4 * ulp).all(), "output: an element is > 4 bf16 ulps off"
    else:
        torch.testing.assert_close(out, ref_out, atol=tol[0], rtol=tol[1])
    for i, (g, w) in enumerate(zip(grads, ref_grads)):
        if g.dtype == torch.bfloat16:
            # torch matmuls over pre-activations that may differ by an ulp, summed over up to
            # M rows: compared as a whole, ||got - want|| / ||want||
            err = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert err <= tol[1], f"grad {i}: relative error {err:.2e}"
            continue
        torch.testing.assert_close(g, w, atol=tol[0], rtol=tol[1], msg=lambda m: f"grad {i}: {m}")


@needs_triton
@pytest.mark.parametrize("epilogue", ["none", "bias", "bias+residual"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_linear(shape, dtype, tol, epilogue):
    x, w, b, gen = _inputs(shape, dtype, lambda n: n)
    r = torch.randn(*x.shape[:-1], w.shape[0], generator=gen).to(DEVICE, dtype)
    dy = torch.randn(r.shape, generator=gen).to(DEVICE)
    leaves = {"none": [x, w], "bias": [x, w, b], "bias+residual": [x, w, b, r]}[epilogue]

    def run(backend):
        return lambda *t: linear(*t, backend=backend)

    _close(_grads(run("triton"), leaves, dy), _grads(run("torch"), leaves, dy), tol)


@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_linear_swiglu(shape, dtype, tol, bias):
    x, w, b, gen = _inputs(shape, dtype, lambda n: 2 * n)
    dy = torch.randn(*x.shape[:-1], w.shape[0] // 2, generator=gen).to(DEVICE)
    leaves = [x, w, b] if bias else [x, w]
    got = _grads(lambda *t: linear_swiglu(*t, backend="triton"), leaves, dy)
    want = _grads(lambda *t: linear_swiglu(*t, backend="torch"), leaves, dy)
    _close(got, want, tol)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_wgrad_accumulate(shape, dtype, tol):
    x, w, _, gen = _inputs(shape, dtype, lambda n: n)
    dy = torch.randn(*x.shape[:-1], w.shape[0], generator=gen).to(DEVICE, dtype)
    start = torch.randn(w.shape, generator=gen).to(DEVICE)  # an earlier micro-batch's grad
    got, want = start.clone(), start.clone()
    for _ in range(2):  # accumulates, never overwrites
        wgrad_accumulate_(got, dy, x, backend="triton")
        reference.wgrad_accumulate_(want, dy, x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)  # fp32 accumulation either way
    with pytest.raises(ValueError, match="main_grad must be fp32, bf16 or fp16"):
        wgrad_accumulate_(got.double(), dy, x, backend="triton")


def _round_once(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``v`` rounded to ``dtype`` as the kernel's store does: to nearest even, except
    that Triton's CPU interpreter truncates fp32 -> bf16 (see the module docstring)."""
    if dtype == torch.bfloat16 and _triton.interpreting():
        return (v.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    return v.to(dtype)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_wgrad_accumulate_into_16bit_main_grad(shape, grad_dtype):
    """optim.master_weights: the main grad is bf16 (fp16 alike) and so are dy and x. The
    kernel adds the fp32 dy.T @ x to the upcast buffer and rounds the sum ONCE.
    Random inputs: within one ulp of the reference (fp32 sums in another order may
    straddle a rounding boundary; the interpreter truncates bf16), per call, so the check
    cannot drift. Exact inputs (small integers times quarters: every fp32 sum exact in any
    order): bitwise the single rounding of buf + dy.T @ x, and not the two-rounding
    result of a 16-bit dw added to the buffer (which these inputs make differ)."""
    x, w, _, gen = _inputs(shape, grad_dtype, lambda n: n)
    dy = torch.randn(*x.shape[:-1], w.shape[0], generator=gen).to(DEVICE, grad_dtype)
    got = torch.randn(w.shape, generator=gen).to(DEVICE, grad_dtype)
    eps = torch.finfo(grad_dtype).eps  # ulp(v) <= |v| * eps
    for _ in range(2):  # accumulates, never overwrites
        want = reference.wgrad_accumulate_(got.clone(), dy, x)
        wgrad_accumulate_(got, dy, x, backend="triton")
        assert got.dtype == grad_dtype
        err = (got.float() - want.float()).abs()
        bound = eps * torch.maximum(got.float().abs(), want.float().abs()) + 1e-5
        assert (err <= bound).all(), f"{(err / bound).max().item():.2f} ulps off"
    *lead, k, n = shape
    dy = torch.randint(-3, 4, (*lead, n), generator=gen).to(DEVICE, grad_dtype)
    x = (torch.randint(-512, 513, (*lead, k), generator=gen) / 512).to(DEVICE, grad_dtype)
    buf = (torch.randn(n, k, generator=gen) * 4).to(DEVICE, grad_dtype)  # full mantissas: the add rounds
    exact = buf.float() + dy.reshape(-1, n).float().t() @ x.reshape(-1, k).float()
    got = wgrad_accumulate_(buf.clone(), dy, x, backend="triton")
    assert torch.equal(got, _round_once(exact, grad_dtype))
    twice = buf + (exact - buf.float()).to(grad_dtype)  # dw rounded to 16 bits, then the 16-bit add
    if x.numel() > k:  # sums of several products need more bits than 16-bit dw keeps
        assert not torch.equal(twice, got)


def test_dispatch():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    with pytest.raises(RuntimeError, match="linear backend 'cuda' is not available: tensors are on cpu"):
        resolve_backend("cuda", cpu)
    with pytest.raises(ValueError, match="even number of rows"):
        linear_swiglu(torch.ones(2, 3), torch.ones(5, 3))


@needs_triton
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (True, True)], ids=["w", "bias", "bias+res"])
def test_layer_linear_accumulates_into_main_grad(bias, residual):
    """The layers' fused path (layer_linear on triton): same output and x/bias/residual
    grads as F.linear; the weight gradient lands in a preset fp32 .grad (the flat
    buffer's view: same storage, accumulated over two backwards), autograd's
    post-accumulate-grad hook still fires once per backward, and without a .grad the
    weight gradient comes back through autograd as usual. fp32: 1e-5 (summation order)."""
    x, w, b, gen = _inputs((2, 19, 24, 40), torch.float32, lambda n: n)
    r = torch.randn(2, 19, 40, generator=gen).to(DEVICE)
    dy = torch.randn(2, 19, 40, generator=gen).to(DEVICE)
    args = lambda: [t.detach().clone().requires_grad_() for t in (x, w, b, r)]  # noqa: E731
    want = args()
    ref = layer_linear(want[0], want[1], want[2] if bias else None, want[3] if residual else None, backend="torch")
    ref.backward(dy)
    for preset in (True, False):
        got = args()
        fired = []
        got[1].register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
        if preset:
            buf = torch.zeros(w.numel(), device=DEVICE)
            got[1].grad = buf.view_as(w)
        for _ in range(2):
            out = layer_linear(got[0], got[1], got[2] if bias else None, got[3] if residual else None,
                               backend="triton")
            out.backward(dy)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1].grad, 2 * want[1].grad, atol=1e-5, rtol=1e-5)
        assert len(fired) == 2 and torch.equal(fired[1], got[1].grad)
        if preset:
            assert got[1].grad.data_ptr() == buf.data_ptr()  # still the flat buffer's view
        torch.testing.assert_close(got[0].grad, 2 * want[0].grad, atol=1e-5, rtol=1e-5)
        if bias:
            torch.testing.assert_close(got[2].grad, 2 * want[2].grad, atol=1e-5, rtol=1e-5)
        if residual:
            torch.testing.assert_close(got[3].grad, 2 * want[3].grad, atol=0, rtol=0)


@needs_triton
def test_layer_linear_accumulates_into_bf16_main_grad(monkeypatch):
    """optim.master_weights: a bf16 weight whose .grad is a view into a bf16 flat buffer,
    under bf16 autocast. Each backward adds dy.T @ x into the buffer with one rounding
    (within one ulp of reference.wgrad_accumulate_ from the buffer's previous value; the
    interpreter truncates), the buffer keeps its storage (the zero placeholder is bf16),
    the post-accumulate-grad hook fires per backward, and x's grad is the torch path's."""
    from megaft.kernels.linear import triton as tl_linear

    x, w, b, gen = _inputs((2, 19, 24, 40), torch.bfloat16, lambda n: n)
    dy = torch.randn(2, 19, 40, generator=gen).to(DEVICE, torch.bfloat16)
    buf = torch.randn(w.numel(), generator=gen).to(DEVICE, torch.bfloat16)
    wx = w.clone().requires_grad_()
    wx.grad = buf.view_as(w)
    fired, into = [], []
    wx.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    real = tl_linear.wgrad_accumulate_
    monkeypatch.setattr(tl_linear, "wgrad_accumulate_", lambda g, *a: (into.append(g.data_ptr()), real(g, *a))[1])
    for _ in range(2):
        before = buf.clone().view_as(w)
        xi = x.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = layer_linear(xi, wx, b, backend="triton")
        out.backward(dy)
        want = reference.wgrad_accumulate_(before, dy, x)
        err = (wx.grad.float() - want.float()).abs()  # one bf16 ulp (<= 2^-7 relative)
        assert (err <= 2.0 ** -7 * want.float().abs().clamp_min(wx.grad.float().abs()) + 1e-5).all()
        xr = x.clone().requires_grad_()
        reference.linear(xr, w, b).backward(dy)
        assert ((xi.grad.float() - xr.grad.float()).norm() / xr.grad.float().norm()).item() <= 1e-2
    assert into == [buf.data_ptr()] * 2  # the fused kernel, into the flat buffer, once per backward
    assert wx.grad.dtype == torch.bfloat16 and wx.grad.data_ptr() == buf.data_ptr()
    assert len(fired) == 2 and torch.equal(fired[1], wx.grad)


@needs_triton
def test_layer_linear_under_autocast_keeps_fp32_weight_grads():
    """bf16 autocast: the fused path computes in bf16 (as F.linear would), accumulates the
    weight gradient in fp32 (no bf16 rounding of dw: closer to fp32 math than the torch
    path), and an fp32 residual stays a separate add (output fp32, as residual + y)."""
    x, w, _, gen = _inputs((2, 19, 24, 40), torch.float32, lambda n: n)
    r = torch.randn(2, 19, 40, generator=gen).to(DEVICE)
    dy = torch.randn(2, 19, 40, generator=gen).to(DEVICE)
    exact = layer_linear(x, w, None, r, backend="torch")
    wx = w.clone().requires_grad_()
    wx.grad = torch.zeros_like(w)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = layer_linear(x, wx, None, r, backend="triton")
    assert out.dtype == torch.float32
    out.backward(dy)
    assert ((out - exact).norm() / exact.norm()).item() <= 1e-2
    want_dw = dy.reshape(-1, 40).t() @ x.reshape(-1, 24)
    assert wx.grad.dtype == torch.float32
    assert ((wx.grad - want_dw).norm() / want_dw.norm()).item() <= 1e-2


@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_fused_gate_up_swiglu_two_weights(dtype, tol, bias):
    """The MLP's gate/up + SwiGLU over two separate weights (HF's gate_proj / up_proj, no
    cat) equals reference.linear_swiglu over their cat, fwd and all grads; with preset fp32
    .grad buffers the weight gradients land there (and nothing else is added)."""
    from megaft.kernels.linear.fused import fused_gate_up_swiglu

    x, w, b, gen = _inputs((37, 40, 24), dtype, lambda n: 2 * n)
    dy = torch.randn(37, 24, generator=gen).to(DEVICE, dtype)
    bias_ = b if bias else None
    leaves = [x, w] + ([bias_] if bias else [])
    want = _grads(lambda x, w, *b: reference.linear_swiglu(x, w, b[0] if b else None), leaves, dy)
    f = w.shape[0] // 2

    def split(x, w, *b):
        bg, bu = (b[0][:f], b[0][f:]) if b else (None, None)
        return fused_gate_up_swiglu(x, w[:f], w[f:], bg, bu)

    got = _grads(split, leaves, dy)
    _close(got, want, tol)
    if dtype == torch.float32:
        wg, wu = (w[:f].clone().requires_grad_(), w[f:].clone().requires_grad_())
        wg.grad, wu.grad = torch.zeros_like(wg), torch.zeros_like(wu)
        fused_gate_up_swiglu(x, wg, wu).backward(dy)
        ref_w = w.clone().requires_grad_()
        reference.linear_swiglu(x, ref_w).backward(dy)
        torch.testing.assert_close(torch.cat([wg.grad, wu.grad]), ref_w.grad, atol=1e-5, rtol=1e-5)
