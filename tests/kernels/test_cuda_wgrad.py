"""Gradient-accumulation fusion in CUDA C++ (csrc/cuda/wgrad.cu: cuBLAS GemmEx, beta = 1
into the fp32 main grad) and the linear layers' cuda backend built on it.

GPU tests (marked `gpu`, skipped with the reason without a GPU and megaft._cuda):
``wgrad_accumulate_(backend="cuda")`` against reference.wgrad_accumulate_ (fp32 addmm of
the upcast operands) on odd shapes, accumulating twice; the layers' path (weight.grad
as the main grad) against the torch path. The CPU test runs the layers' cuda path with
the op emulated (host-side logic: placeholder gradient, main-grad accumulation, the
forward equal to torch's), not cuBLAS.

Tolerances (atol, rtol): fp32 inputs 1e-5 relative with atol 1e-4 (cuBLAS and the
reference sum K-long fp32 dot products in other orders; values of order sqrt(M)); half
inputs: products are exact in fp32 both ways, so the same tolerance holds.
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import dispatch
from megaft.kernels.linear import cuda as cu_linear
from megaft.kernels.linear import reference, wgrad_accumulate_
from megaft.kernels.linear.fused import fused_linear
from megaft.layers.linear import ColumnParallelLinear, RowParallelLinear

_WHY = ("no CUDA GPU" if not torch.cuda.is_available()
        else dispatch.cuda_unavailable_reason("linear", torch.device("cuda")))
needs_cuda_wgrad = pytest.mark.skipif(_WHY is not None, reason=f"CUDA wgrad cannot run: {_WHY}")
TOL = (1e-4, 1e-5)
SHAPES = [(1, 1, 1), (37, 50, 40), (2, 17, 33, 50), (513, 1000, 257), (4096, 1024, 2048)]  # (..., M, N, K)


@pytest.mark.gpu
@needs_cuda_wgrad
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_wgrad_accumulate_cuda(shape, dtype):
    *lead, n, k = shape
    gen = torch.Generator().manual_seed(0)
    dy = torch.randn(*lead, n, generator=gen).to("cuda", dtype)
    x = torch.randn(*lead, k, generator=gen).to("cuda", dtype)
    start = torch.randn(n, k, generator=gen).cuda()
    got, want = start.clone(), start.clone()
    for _ in range(2):  # accumulates: beta = 1
        wgrad_accumulate_(got, dy, x, backend="cuda")
        reference.wgrad_accumulate_(want, dy, x)
    torch.testing.assert_close(got, want, atol=TOL[0], rtol=TOL[1])
    with pytest.raises(ValueError, match="main_grad must be fp32"):
        wgrad_accumulate_(got.to(torch.bfloat16), dy, x, backend="cuda")


def _layer_grads(layer_cls, backend, x, dy, seed=0, residual=None, **kw):
    """(y, dx, weight main grad, bias grad) with weight.grad preset to an fp32 buffer."""
    torch.manual_seed(seed)
    layer = layer_cls(x.shape[-1], dy.shape[-1], group=None, backend=backend, **kw).to(x.device)
    torch.nn.init.normal_(layer.weight, std=0.2)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    start = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(5)).to(x.device)
    layer.weight.grad = start.clone()  # the main grad FlatParams would install
    xi = x.clone().requires_grad_()
    y = layer(xi) if residual is None else layer(xi, residual)
    y.backward(dy)
    return y.detach(), xi.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def _check_layers(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 24, generator=gen).to(device)
    dy = torch.randn(3, 7, 40, generator=gen).to(device)
    res = torch.randn(3, 7, 40, generator=gen).to(device)
    for cls, kw, r in ((ColumnParallelLinear, {"bias": True}, None), (RowParallelLinear, {"bias": True}, res),
                       (ColumnParallelLinear, {}, None)):
        want = _layer_grads(cls, "torch", x, dy, residual=r, **kw)
        got = _layer_grads(cls, "cuda", x, dy, residual=r, **kw)
        for what, g, w in zip(("y", "dx", "main grad", "dbias"), got, want):
            if w is None:
                assert g is None, what
                continue
            # the forward is the same torch op (exact); grads may sum in another order
            tol = (0.0, 0.0) if what == "y" else TOL
            torch.testing.assert_close(g, w, atol=tol[0], rtol=tol[1], msg=lambda m: f"{cls.__name__} {what}: {m}")


@pytest.mark.gpu
@needs_cuda_wgrad
def test_layers_cuda_backend_accumulate_into_main_grad():
    _check_layers("cuda")


def test_layers_cuda_path_on_cpu_with_emulated_op(monkeypatch):
    """Host-side logic of the cuda linear backend with the cuBLAS op emulated on CPU."""
    calls = []

    class Ops:
        @staticmethod
        def wgrad_accumulate(main_grad, dy, x):
            assert main_grad.dtype == torch.float32 and dy.dim() == x.dim() == 2
            calls.append(tuple(main_grad.shape))
            main_grad.addmm_(dy.t().float(), x.float())

    monkeypatch.setattr(cu_linear, "_ops", lambda: Ops)
    # the layers resolve their backend from the device; on CPU call the fused path directly
    monkeypatch.setattr("megaft.kernels.linear.resolve_backend", lambda backend, device: backend)
    monkeypatch.setattr("megaft.layers.linear.resolve_backend", lambda backend, device: backend)
    _check_layers("cpu")
    assert calls == [(40, 24)] * 3, calls  # one accumulation per layer, into the main grad
    # without a main grad the weight gradient is returned as usual
    w = torch.randn(5, 4, requires_grad=True)
    x = torch.randn(3, 4)
    fused_linear(x, w, backend="cuda").sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(3, 5).t() @ x)
    assert calls == [(40, 24)] * 3
    with pytest.raises(ValueError, match="dy and x must share a dtype"):
        cu_linear.wgrad_accumulate_(torch.zeros(5, 4), torch.zeros(3, 5), torch.zeros(3, 4, dtype=torch.bfloat16))
