"""RMSNorm (plain and with the fused residual add): every backend against reference.py,
output and all grads (x, weight, residual), plus the dispatch rules.

Without a GPU the Triton kernels run in Triton's CPU interpreter (tests/kernels/
conftest.py sets TRITON_INTERPRET=1), so shapes stay small. The @gpu test runs
them compiled on larger shapes.

Tolerances, (x dtype, weight dtype, atol, rtol):
- fp32: 1e-5. Same math in fp32; only the summation order of mean(x^2), of the
  backward row reductions and of the dw partial sums differ.
- fp16: 1e-3 on the outputs, 1e-2 on grads: reference autograd rounds each
  backward op to fp16, the kernel rounds once.
- bf16: 1e-2 relative (the usual), atol 1e-2 (outputs) / 5e-2 (grads, of order 1-10
  here). Interpreted, both are doubled: Triton's interpreter truncates fp32 -> bf16
  casts (round toward zero; triton 3.x `interpreter._convert_float` gets no
  rounding mode) where GPUs round to nearest even, and the fused path rounds three
  times (h, normalized row, y), so an element may land 2 bf16 ulps (2^-7 relative
  each) off the reference.
- dweight in fp16/bf16 sums over every row; the reference rounds dy * normed to the
  half type before summing, the kernel does not, so it is compared as a whole:
  ||got - want|| / ||want|| <= the grad rtol (measured ~5e-3 on (5, 123, 123), 615 rows).
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import _triton
from megaft.kernels.rmsnorm import reference, resolve_backend, rmsnorm
from megaft.layers.norm import RMSNorm

# (x dtype, weight dtype, atol/rtol of outputs, atol/rtol of grads)
DTYPES = [
    pytest.param(torch.float32, torch.float32, (1e-5, 1e-5), (1e-5, 1e-5), id="fp32"),
    pytest.param(torch.float16, torch.float16, (1e-3, 1e-3), (1e-2, 1e-2), id="fp16"),
    pytest.param(torch.bfloat16, torch.bfloat16, (1e-2, 1e-2), (5e-2, 1e-2), id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, (1e-2, 1e-2), (5e-2, 1e-2), id="bf16-w32"),
]
# tails and non-power-of-two hidden sizes (Liger's odd 5 x 123 x 123, with fewer rows:
# the interpreter runs one Python-level program per row)
SHAPES = [(1, 1), (5, 123), (2, 3, 97), (3, 128), (5, 17, 123)]
EPS = 1e-6

needs_triton = pytest.mark.skipif(_triton.unavailable_reason(torch.device("cpu")) is not None
                                  and not torch.cuda.is_available(),
                                  reason=f"triton cannot run here: "
                                         f"{_triton.unavailable_reason(torch.device('cpu'))}")


def _inputs(shape, dtype, wdtype, residual, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(device, wdtype)
    r = torch.randn(shape, generator=gen).to(device, dtype) if residual else None
    return x, w, r


def _run(fn, x, w, r, grads):
    """Outputs and grads (x, w[, r]) of fn for upstream grads ``grads``."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((r,) if r is not None else ())]
    out = fn(leaves[0], leaves[1], leaves[2] if r is not None else None)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads)])
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _check(shape, dtype, wdtype, out_tol, grad_tol, residual, device, seed=0):
    if dtype == torch.bfloat16 and device == "cpu":  # interpreted: truncating casts
        out_tol, grad_tol = (2 * out_tol[0], 2 * out_tol[1]), (2 * grad_tol[0], 2 * grad_tol[1])
    x, w, r = _inputs(shape, dtype, wdtype, residual, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(shape, generator=gen).to(device) for _ in range(2 if residual else 1)]
    ref_outs, ref_grads = _run(lambda a, b, c: reference.rmsnorm(a, b, EPS, c), x, w, r, grads)
    outs, got_grads = _run(lambda a, b, c: rmsnorm(a, b, EPS, "triton", residual=c), x, w, r, grads)
    for name, got, want in zip(("y", "h"), outs, ref_outs):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got, want, atol=out_tol[0], rtol=out_tol[1], msg=lambda m: f"{name}: {m}")
    for name, got, want in zip(("dx", "dweight", "dresidual"), got_grads, ref_grads):
        assert got.dtype == want.dtype, name
        if name == "dweight" and dtype != torch.float32:
            # a sum over all rows: compare as a whole, ||got - want|| / ||want||
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err <= grad_tol[1], f"dweight: relative error {err:.2e} > {grad_tol[1]:.0e}"
            continue
        torch.testing.assert_close(got, want, atol=grad_tol[0], rtol=grad_tol[1], msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,wdtype,out_tol,grad_tol", DTYPES)
def test_triton_matches_reference(shape, dtype, wdtype, out_tol, grad_tol, residual):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(shape, dtype, wdtype, out_tol, grad_tol, residual, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to run Triton compiled")
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(4, 2048, 4096), (3, 1000, 5120), (2, 513, 8192), (7, 11008)], ids=str)
@pytest.mark.parametrize("dtype,wdtype,out_tol,grad_tol", DTYPES)
def test_triton_matches_reference_gpu(shape, dtype, wdtype, out_tol, grad_tol, residual):
    _check(shape, dtype, wdtype, out_tol, grad_tol, residual, "cuda")


def test_reference_equals_layer():
    x, w, r = _inputs((2, 3, 97), torch.bfloat16, torch.float32, True)
    layer = RMSNorm(97, eps=EPS)
    with torch.no_grad():
        layer.weight.copy_(w)
    assert torch.equal(reference.rmsnorm(x, w, EPS), layer(x))
    y, h = reference.rmsnorm(x, w, EPS, r)
    assert torch.equal(h, x + r) and torch.equal(y, layer(x + r))


def test_torch_backend_is_reference():
    x, w, r = _inputs((5, 123), torch.float32, torch.float32, True)
    assert torch.equal(rmsnorm(x, w, EPS, "torch"), reference.rmsnorm(x, w, EPS))
    assert torch.equal(rmsnorm(x, w, EPS, "auto"), reference.rmsnorm(x, w, EPS))
    for a, b in zip(rmsnorm(x, w, EPS, "torch", residual=r), reference.rmsnorm(x, w, EPS, r)):
        assert torch.equal(a, b)


def test_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"  # the CPU path stays torch, interpreter or not
    assert resolve_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("cuda-graph", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="rmsnorm backend 'triton' is not available.*TRITON_INTERPRET"):
        rmsnorm(torch.ones(2, 3), torch.ones(3), EPS, "triton")
    if torch.cuda.is_available() and _triton.import_error() is None:
        assert resolve_backend("auto", torch.device("cuda")) == "triton"
