"""The cuBLASLt GEMM with fused bias/residual epilogue (csrc/cuda/linear_epilogue.cu,
``torch.ops.megaft.linear_fwd``) and the linear fronts' cuda backend built on it.

GPU tests (marked `gpu`, skipped with the reason without a GPU and megaft._cuda). The
op's operand mapping is also checked without a GPU, against a host model of cuBLASLt
(tests/test_csrc_compile.py), and the host-side wiring with the op emulated on CPU
(tests/kernels/test_cuda_wgrad.py).

Reference: reference.py's rounding rule (fp32 accumulation and epilogue, one rounding),
i.e. the torch reference evaluated in fp32 on the same (rounded) inputs, then compared
in fp32. Tolerances (atol, rtol): fp32 1e-4 / 1e-5 (cuBLASLt and torch sum the K-long
fp32 dot products in other orders; values of order sqrt(K)); bf16 and fp16 1e-2 / 1e-2
(one rounding of the output, 2^-9 resp. 2^-12 relative, plus fp32 order differences).
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import dispatch
from megaft.kernels.linear import cuda as cu_linear
from megaft.kernels.linear import linear, linear_swiglu, reference

_WHY = ("no CUDA GPU" if not torch.cuda.is_available()
        else dispatch.cuda_unavailable_reason("linear", torch.device("cuda")))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=f"CUDA linear cannot run: {_WHY}")]

TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-2, 1e-2)}
# (..., M, K, N): a single element, odd sizes (no multiple of 8 anywhere), a batched
# [B, S, K] input, a tail-heavy mid size and a model-like one
SHAPES = [(1, 1, 1), (37, 41, 50), (2, 17, 33, 50), (513, 1000, 257), (512, 1024, 1536)]


def _inputs(shape, dtype, seed=0):
    *lead, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to("cuda", dtype)
    b = torch.randn(n, generator=gen).to("cuda", dtype)
    r = torch.randn(*lead, n, generator=gen).to("cuda", dtype)
    return x, w, b, r


def _want(x, w, b, r):
    """The spec in fp32 on the same inputs: one rounding, as reference.py states."""
    def up(t):
        return None if t is None else t.float()

    return reference.linear(up(x), up(w), up(b), up(r))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_linear_fwd_op(shape, dtype):
    x, w, b, r = _inputs(shape, dtype)
    atol, rtol = TOL[dtype]
    for bias in (None, b):
        for res in (None, r):
            got = torch.ops.megaft.linear_fwd(x, w, bias, res)
            assert got.dtype == dtype and got.shape == (*x.shape[:-1], w.shape[0])
            torch.testing.assert_close(got.float(), _want(x, w, bias, res), atol=atol, rtol=rtol,
                                       msg=lambda m: f"bias={bias is not None} res={res is not None}: {m}")
    if dtype == torch.float32:  # and equal to torch's own fp32 linear (no TF32 either way)
        torch.testing.assert_close(torch.ops.megaft.linear_fwd(x, w, b, r), reference.linear(x, w, b, r),
                                   atol=atol, rtol=rtol)


def test_linear_fwd_views_and_empty_sums():
    """Operands that start mid-allocation (2-byte aligned bf16 views: cuBLASLt must be told
    their alignment), k = 0 (y is the epilogue alone) and m = 0."""
    m, k, n = 37, 41, 50
    gen = torch.Generator().manual_seed(3)

    def shifted(*shape):  # contiguous, one element past an aligned allocation
        numel = torch.Size(shape).numel()
        return torch.randn(numel + 1, generator=gen).to("cuda", torch.bfloat16)[1:].view(shape)

    x, w, b, r = shifted(m, k), shifted(n, k), shifted(n), shifted(m, n)
    assert all(t.data_ptr() % 4 == 2 for t in (x, w, b, r))  # too little for a vectorized kernel
    torch.testing.assert_close(torch.ops.megaft.linear_fwd(x, w, b, r).float(), _want(x, w, b, r),
                               atol=1e-2, rtol=1e-2)
    x0, w0 = torch.ones(m, 0, device="cuda"), torch.ones(n, 0, device="cuda")
    b0, r0 = torch.randn(n, device="cuda"), torch.randn(m, n, device="cuda")
    torch.testing.assert_close(torch.ops.megaft.linear_fwd(x0, w0, b0, r0), r0 + b0, atol=0, rtol=0)
    assert torch.ops.megaft.linear_fwd(torch.ones(0, k, device="cuda"), torch.ones(n, k, device="cuda"),
                                       None, None).shape == (0, n)


def test_linear_fwd_errors_name_the_problem():
    x, w, b, r = _inputs((6, 8, 5), torch.float32)
    op = torch.ops.megaft.linear_fwd
    with pytest.raises(RuntimeError, match=r"x must be contiguous.*x\.contiguous\(\)"):
        op(x.t().contiguous().t(), w, b, r)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        op(x, w.t().contiguous().t(), b, r)
    with pytest.raises(RuntimeError, match="residual must be contiguous"):
        op(x, w, b, r.t().contiguous().t())
    with pytest.raises(RuntimeError, match="weight is BFloat16 and x is Float"):
        op(x, w.bfloat16(), None, None)
    with pytest.raises(RuntimeError, match=r"bias must be Float \[5\]"):
        op(x, w, b[:4], None)
    with pytest.raises(RuntimeError, match=r"x \[\.\.\., K\] and weight \[N, K\]"):
        op(x, w[:, :7].contiguous(), None, None)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        op(x, w, b.cpu(), None)
    # the Python wrapper copies non-contiguous operands instead (the layers' inputs may be views)
    torch.testing.assert_close(cu_linear.gemm(x.t().contiguous().t(), w, b, r), op(x, w, b, r), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_fronts_cuda_fwd_bwd(dtype):
    """linear / linear_swiglu with backend="cuda" (cuBLASLt forward, autograd through
    megaft.kernels.linear.fused; SwiGLU by the CUDA kernel) against the torch reference:
    output and the x, w, bias (and residual) grads."""
    atol, rtol = TOL[dtype]
    for shape in [(2, 17, 33, 50), (513, 1000, 257)]:
        x, w, b, r = _inputs(shape, dtype, seed=1)
        ws = torch.cat([w, w.flip(0)])  # [2F, K] gate/up
        cases = [("linear", lambda be, *a: linear(*a, backend=be), (x, w, b, r)),
                 ("linear_swiglu", lambda be, *a: linear_swiglu(*a, backend=be), (x, ws, torch.cat([b, b])))]
        for name, fn, args in cases:
            results = []
            for backend, cast in (("cuda", lambda t: t), ("torch", lambda t: t.float())):
                leaves = [cast(a).detach().requires_grad_() for a in args]
                y = fn(backend, *leaves)
                y.backward(torch.ones_like(y) / y.shape[-1] ** 0.5)
                results.append([y.float(), *(t.grad.float() for t in leaves)])
            for what, g, want in zip(("y", "dx", "dw", "db", "dres"), *results):
                torch.testing.assert_close(g, want, atol=atol * 4, rtol=rtol * 4,
                                           msg=lambda m: f"{name} {shape} {what}: {m}")
