"""The CUDA C++ kernels (megaft._cuda, torch.ops.megaft.*) against the torch references,
forward and all grads; plus the dispatch rule for backend="cuda" everywhere.

Running them needs a GPU and a CUDA build of megaft._cuda: those tests are marked
`gpu` and skipped with the reason otherwise. tests/test_csrc_compile.py compiles the
sources with nvcc on any machine.

Tolerances (atol, rtol): fp32 1e-5 (same math, other summation order in the row
reductions); bf16 1e-2 on outputs, 5e-2 absolute on grads (values of order 1-10; the
references round each autograd op to bf16, the kernels round once); dweight, a sum
over every row, is compared as a whole in half types (relative norm error <= 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import dispatch
from megaft.kernels.rmsnorm import rmsnorm
from megaft.kernels.rope import reference as rope_ref
from megaft.kernels.rope import rope
from megaft.kernels.swiglu import reference as swiglu_ref
from megaft.kernels.swiglu import swiglu
from megaft.models.attention.rope import inv_frequencies, rope_tables

_WHY = ("no CUDA GPU" if not torch.cuda.is_available()
        else dispatch.cuda_unavailable_reason("rmsnorm", torch.device("cuda")))
needs_cuda_kernels = pytest.mark.skipif(_WHY is not None, reason=f"CUDA kernels cannot run: {_WHY}")

DTYPES = [pytest.param(torch.float32, (1e-5, 1e-5), (1e-5, 1e-5), id="fp32"),
          pytest.param(torch.bfloat16, (1e-2, 1e-2), (5e-2, 1e-2), id="bf16")]


def _grads(fn, leaves, upstream):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, upstream)])
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _compare(got, want, out_tol, grad_tol, names):
    (go, gg), (wo, wg) = got, want
    for i, (g, w) in enumerate(zip(go, wo)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"output {i}"
        torch.testing.assert_close(g, w, atol=out_tol[0], rtol=out_tol[1])
    for name, g, w in zip(names, gg, wg):
        if name == "dweight" and g.dtype != torch.float32:
            err = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert err <= 1e-2, f"dweight relative error {err:.2e}"
            continue
        torch.testing.assert_close(g, w, atol=grad_tol[0], rtol=grad_tol[1], msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (3, 1000, 4096), (2, 513, 8192), (7, 11008)], ids=str)
@pytest.mark.parametrize("dtype,out_tol,grad_tol", DTYPES)
def test_rmsnorm_cuda(shape, dtype, out_tol, grad_tol, residual):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to("cuda", dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to("cuda", dtype)
    leaves = [x, w] + ([torch.randn(shape, generator=gen).to("cuda", dtype)] if residual else [])
    upstream = [torch.randn(shape, generator=gen).cuda() for _ in range(2 if residual else 1)]

    def run(backend):
        if residual:
            return lambda a, b, c: rmsnorm(a, b, 1e-6, backend, residual=c)
        return lambda a, b: rmsnorm(a, b, 1e-6, backend)

    want = _grads(run("torch"), leaves, upstream)
    got = _grads(run("cuda"), leaves, upstream)
    _compare(got, want, out_tol, grad_tol, ("dx", "dweight", "dresidual"))


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("shape", [(1,), (5, 123), (3, 1000, 11008), (4097, 1)], ids=str)
@pytest.mark.parametrize("dtype,out_tol,grad_tol", DTYPES)
def test_swiglu_cuda(shape, dtype, out_tol, grad_tol):
    gen = torch.Generator().manual_seed(0)
    g, u, dy = (torch.randn(shape, generator=gen).to("cuda", dtype) for _ in range(3))
    want = _grads(swiglu_ref.swiglu, [g, u], [dy])
    got = _grads(lambda a, b: swiglu(a, b, "cuda"), [g, u], [dy])
    _compare(got, want, out_tol, grad_tol, ("dgate", "dup"))


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("shape", [(1, 4, 4, 1, 2), (2, 6, 2, 37, 48), (2, 32, 8, 1024, 128), (1, 5, 5, 7, 34)],
                         ids=str)
@pytest.mark.parametrize("dtype,out_tol,grad_tol", DTYPES)
def test_rope_cuda(shape, dtype, out_tol, grad_tol):
    b, h, kv, s, d = shape
    gen = torch.Generator().manual_seed(0)
    # q as the model makes it: a [b, s, h, d] projection viewed as [b, h, s, d]
    q = torch.randn(b, s, h, d, generator=gen).to("cuda", dtype).transpose(1, 2)
    k = torch.randn(b, kv, s, d, generator=gen).to("cuda", dtype)
    cos, sin = (t.cuda() for t in rope_tables(inv_frequencies(d, 10000.0), s))
    upstream = [torch.randn(q.shape, generator=gen).cuda(), torch.randn(k.shape, generator=gen).cuda()]
    want = _grads(lambda a, c: rope_ref.rope(a, c, cos, sin), [q, k], upstream)
    got = _grads(lambda a, c: rope(a, c, cos, sin, "cuda"), [q, k], upstream)
    _compare(got, want, out_tol, grad_tol, ("dq", "dk"))


def test_cuda_backend_is_an_error_on_cpu():
    cpu = torch.device("cpu")
    x = torch.ones(2, 4)
    for call in (lambda: rmsnorm(x, torch.ones(4), 1e-6, "cuda"), lambda: swiglu(x, x, "cuda"),
                 lambda: rope(x.view(1, 1, 2, 4), x.view(1, 1, 2, 4), x, x, "cuda")):
        with pytest.raises(RuntimeError, match="backend 'cuda' is not available.*CUDA tensors only"):
            call()
    assert dispatch.resolve("rmsnorm", "auto", cpu) == "torch"
