"""RoPE on q and k: every backend against reference.py, outputs and both grads, for
GQA head counts, head dims that are not powers of two, the model's transposed
(non-contiguous) layout and the in-place variant; plus the dispatch rules.

Without a GPU the Triton kernels run in Triton's CPU interpreter (tests/kernels/
conftest.py sets TRITON_INTERPRET=1). The @gpu test runs them compiled.

Tolerances (dtype, atol, rtol): fp32 1e-5 (the kernel rounds once, torch after each
product and the sum, all in fp32); fp16 1e-3; bf16 1e-2 (the usual relative),
doubled when interpreted because Triton's interpreter truncates fp32 -> bf16 casts
where GPUs round to nearest even.
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import _triton
from megaft.kernels.rope import reference, resolve_backend, rope
from megaft.models.attention.rope import apply_rope, inv_frequencies, rope_tables

DTYPES = [
    pytest.param(torch.float32, (1e-5, 1e-5), id="fp32"),
    pytest.param(torch.float16, (1e-3, 1e-3), id="fp16"),
    pytest.param(torch.bfloat16, (1e-2, 1e-2), id="bf16"),
]
# (batch, q heads, kv heads, seq, head_dim): MHA, GQA, MQA, odd head dims, seq tails
SHAPES = [(1, 1, 1, 1, 2), (2, 4, 2, 5, 64), (1, 6, 1, 7, 46), (2, 3, 3, 3, 126)]

needs_triton = pytest.mark.skipif(_triton.unavailable_reason(torch.device("cpu")) is not None
                                  and not torch.cuda.is_available(),
                                  reason=f"triton cannot run here: "
                                         f"{_triton.unavailable_reason(torch.device('cpu'))}")


def _inputs(shape, dtype, device, transposed):
    b, hq, hk, s, d = shape
    gen = torch.Generator().manual_seed(0)
    if transposed:  # the model's q_proj(x).view(b, s, h, d).transpose(1, 2)
        q = torch.randn(b, s, hq, d, generator=gen).to(device, dtype).transpose(1, 2)
        k = torch.randn(b, s, hk, d, generator=gen).to(device, dtype).transpose(1, 2)
    else:
        q = torch.randn(b, hq, s, d, generator=gen).to(device, dtype)
        k = torch.randn(b, hk, s, d, generator=gen).to(device, dtype)
    cos, sin = rope_tables(inv_frequencies(d, 10000.0, None), s + 3)
    dq = torch.randn(q.shape, generator=gen).to(device, dtype)
    dk = torch.randn(k.shape, generator=gen).to(device, dtype)
    return q, k, cos[:s].to(device), sin[:s].to(device), dq, dk


def _run(fn, q, k, cos, sin, dq, dk):
    # non-leaf copies keep the layout, and may be overwritten in place
    ql, kl = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qo, ko = fn(ql * 1, kl * 1, cos, sin)
    torch.autograd.backward((qo, ko), (dq, dk))
    return qo.detach(), ko.detach(), ql.grad, kl.grad


def _check(shape, dtype, tol, device, transposed, inplace):
    if dtype == torch.bfloat16 and device == "cpu":  # interpreted: truncating casts
        tol = (2 * tol[0], 2 * tol[1])
    q, k, cos, sin, dq, dk = _inputs(shape, dtype, device, transposed)
    want = _run(reference.rope, q, k, cos, sin, dq, dk)
    got = _run(lambda *a: rope(*a, "triton", inplace=inplace), q, k, cos, sin, dq, dk)
    for name, g, w in zip(("q", "k", "dq", "dk"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=tol[0], rtol=tol[1], msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_triton_matches_reference(shape, dtype, tol, transposed, inplace):
    _check(shape, dtype, tol, "cuda" if torch.cuda.is_available() else "cpu", transposed, inplace)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to run Triton compiled")
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("shape", [(2, 32, 8, 2048, 128), (1, 40, 40, 1000, 128), (3, 12, 4, 513, 80)], ids=str)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_triton_matches_reference_gpu(shape, dtype, tol, inplace):
    _check(shape, dtype, tol, "cuda", True, inplace)


def test_reference_equals_model():
    q, k, cos, sin, _, _ = _inputs((2, 4, 2, 5, 64), torch.bfloat16, "cpu", True)
    qo, ko = reference.rope(q, k, cos, sin)
    assert torch.equal(qo, apply_rope(q, cos, sin)) and torch.equal(ko, apply_rope(k, cos, sin))
    for a, b in zip(rope(q, k, cos, sin), (qo, ko)):  # auto on CPU is torch
        assert torch.equal(a, b)


def test_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("cuda-graph", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.ones(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="rope backend 'triton' is not available.*TRITON_INTERPRET"):
        rope(q, q, torch.ones(2, 4), torch.ones(2, 4), "triton")


@needs_triton
def test_inplace_overwrites_q_and_k():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, cos, sin, _, _ = _inputs((2, 4, 2, 5, 64), torch.float32, device, True)
    want = reference.rope(q, k, cos, sin)
    qo, ko = rope(q, k, cos, sin, "triton", inplace=True)
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()
    torch.testing.assert_close((q, k), want, atol=1e-5, rtol=1e-5)
