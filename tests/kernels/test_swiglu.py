"""SwiGLU's activation silu(gate) * up: every backend against reference.py, output
and both grads, plus the dispatch rules.

Without a GPU the Triton kernels run in Triton's CPU interpreter (tests/kernels/
conftest.py sets TRITON_INTERPRET=1). The @gpu test runs them compiled.

Tolerances (dtype, atol, rtol):
- fp32: 1e-5 (the kernel's sigmoid is 1 / (1 + exp(-x)) in fp32, torch's silu the same
  up to an ulp or two).
- fp16: 1e-3 outputs, 1e-2 grads: reference autograd rounds each backward op
  (silu' and the products) to fp16, the kernel rounds once.
- bf16: 1e-2 (the usual relative); interpreted, doubled, because Triton's
  interpreter truncates fp32 -> bf16 casts where GPUs round to nearest even and
  the forward rounds twice (silu(gate), then the product).
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import _triton
from megaft.kernels.swiglu import reference, resolve_backend, swiglu

DTYPES = [
    pytest.param(torch.float32, (1e-5, 1e-5), (1e-5, 1e-5), id="fp32"),
    pytest.param(torch.float16, (1e-3, 1e-3), (1e-2, 1e-2), id="fp16"),
    pytest.param(torch.bfloat16, (1e-2, 1e-2), (1e-2, 1e-2), id="bf16"),
]
# tails of the 1024-element block, non-power-of-two widths, several blocks
SHAPES = [(1, 1), (5, 123), (2, 3, 97), (3, 1024), (5, 7, 123)]

needs_triton = pytest.mark.skipif(_triton.unavailable_reason(torch.device("cpu")) is not None
                                  and not torch.cuda.is_available(),
                                  reason=f"triton cannot run here: "
                                         f"{_triton.unavailable_reason(torch.device('cpu'))}")


def _run(fn, gate, up, dy):
    g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    y = fn(g, u)
    y.backward(dy)
    return y.detach(), g.grad, u.grad


def _check(shape, dtype, out_tol, grad_tol, device):
    if dtype == torch.bfloat16 and device == "cpu":  # interpreted: truncating casts
        out_tol, grad_tol = (2 * out_tol[0], 2 * out_tol[1]), (2 * grad_tol[0], 2 * grad_tol[1])
    gen = torch.Generator().manual_seed(0)
    gate, up, dy = (3 * torch.randn(shape, generator=gen)).to(device, dtype), \
        torch.randn(shape, generator=gen).to(device, dtype), torch.randn(shape, generator=gen).to(device, dtype)
    want = _run(reference.swiglu, gate, up, dy)
    got = _run(lambda a, b: swiglu(a, b, "triton"), gate, up, dy)
    for name, g, w in zip(("y", "dgate", "dup"), got, want):
        tol = out_tol if name == "y" else grad_tol
        assert g.dtype == w.dtype and g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=tol[0], rtol=tol[1], msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,out_tol,grad_tol", DTYPES)
def test_triton_matches_reference(shape, dtype, out_tol, grad_tol):
    _check(shape, dtype, out_tol, grad_tol, "cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to run Triton compiled")
@pytest.mark.parametrize("shape", [(4, 2048, 11008), (3, 1000, 14336), (8191, 123)], ids=str)
@pytest.mark.parametrize("dtype,out_tol,grad_tol", DTYPES)
def test_triton_matches_reference_gpu(shape, dtype, out_tol, grad_tol):
    _check(shape, dtype, out_tol, grad_tol, "cuda")


def test_non_contiguous_inputs():
    """gate and up as column halves of one fused gate/up projection output."""
    if _triton.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(reason="triton cannot run on CPU here")
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(6, 2 * 37, generator=gen).chunk(2, dim=-1)
    dy = torch.randn(6, 37, generator=gen)
    for g, w in zip(_run(lambda a, b: swiglu(a, b, "triton"), gate, up, dy),
                    _run(reference.swiglu, gate, up, dy)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_torch_backend_is_reference():
    gate, up = torch.randn(5, 123), torch.randn(5, 123)
    assert torch.equal(swiglu(gate, up, "torch"), torch.nn.functional.silu(gate) * up)
    assert torch.equal(swiglu(gate, up), reference.swiglu(gate, up))


def test_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"  # the CPU path stays torch, interpreter or not
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("cuda-graph", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="swiglu backend 'triton' is not available.*TRITON_INTERPRET"):
        swiglu(torch.ones(3), torch.ones(3), "triton")
    if torch.cuda.is_available() and _triton.import_error() is None:
        assert resolve_backend("auto", torch.device("cuda")) == "triton"
