"""Gradient-accumulation fusion in CUDA C++ (csrc/cuda/wgrad.cu: cuBLAS GemmEx, beta = 1
into the main grad: fp32, or bf16/fp16 under optim.master_weights) and the linear
layers' cuda backend built on it.

GPU tests (marked `gpu`, skipped with the reason without a GPU and megaft._cuda):
``wgrad_accumulate_(backend="cuda")`` against reference.wgrad_accumulate_ (fp32 addmm of
the upcast operands, rounded once to the main grad's dtype) on odd shapes, accumulating
twice; the layers' path (weight.grad as the main grad, the forward by cuBLASLt:
csrc/cuda/linear_epilogue.cu) against the torch path. The CPU test runs the layers' cuda
path with both ops emulated (host-side logic: which op gets which operands, placeholder
gradient, main-grad accumulation, the bf16 main grad), not cuBLAS; the op itself is
tests/kernels/test_cuda_linear.py.

Tolerances (atol, rtol): fp32 inputs 1e-5 relative with atol 1e-4 (cuBLAS and the
reference sum K-long fp32 dot products in other orders; values of order sqrt(M)); half
inputs: products are exact in fp32 both ways, so the same tolerance holds. A 16-bit main
grad: one ulp of its dtype per call (both round the fp32 sum once, to nearest even; the
sums' order may still put them on two sides of a rounding boundary).
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import dispatch
from megaft.kernels.linear import cuda as cu_linear
from megaft.kernels.linear import linear, linear_swiglu, reference, wgrad_accumulate_
from megaft.kernels.linear.fused import fused_linear
from megaft.layers.linear import ColumnParallelLinear, RowParallelLinear

_WHY = ("no CUDA GPU" if not torch.cuda.is_available()
        else dispatch.cuda_unavailable_reason("linear", torch.device("cuda")))
needs_cuda_wgrad = pytest.mark.skipif(_WHY is not None, reason=f"CUDA wgrad cannot run: {_WHY}")
TOL = (1e-4, 1e-5)
SHAPES = [(1, 1, 1), (37, 50, 40), (2, 17, 33, 50), (513, 1000, 257), (4096, 1024, 2048)]  # (..., M, N, K)


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    eps = torch.finfo(want.dtype).eps  # ulp(v) <= |v| * eps
    err = (got.float() - want.float()).abs()
    bound = eps * torch.maximum(got.float().abs(), want.float().abs()) + TOL[0]
    assert got.dtype == want.dtype and (err <= bound).all(), f"{(err / bound).max().item():.2f} ulps off"


@pytest.mark.gpu
@needs_cuda_wgrad
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("main", ["fp32", "own"], ids=["fp32_main", "own_dtype_main"])
def test_wgrad_accumulate_cuda(shape, dtype, main):
    *lead, n, k = shape
    gen = torch.Generator().manual_seed(0)
    dy = torch.randn(*lead, n, generator=gen).to("cuda", dtype)
    x = torch.randn(*lead, k, generator=gen).to("cuda", dtype)
    start = torch.randn(n, k, generator=gen).to("cuda", torch.float32 if main == "fp32" else dtype)
    got, want = start.clone(), start.clone()
    for _ in range(2):  # accumulates: beta = 1
        if got.dtype != torch.float32:  # one rounding per call: compare each call from the same buffer
            want = reference.wgrad_accumulate_(got.clone(), dy, x)
        wgrad_accumulate_(got, dy, x, backend="cuda")
        if got.dtype == torch.float32:
            reference.wgrad_accumulate_(want, dy, x)
        else:
            _within_one_ulp(got, want)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=TOL[0], rtol=TOL[1])
    with pytest.raises(ValueError, match="main_grad must be fp32, bf16 or fp16"):
        wgrad_accumulate_(got.double(), dy, x, backend="cuda")
    if dtype != torch.float32:  # cuBLAS has no fp32 A/B into a 16-bit C
        with pytest.raises(ValueError, match="needs dy and x of that dtype"):
            wgrad_accumulate_(got.to(dtype), dy.float(), x.float(), backend="cuda")


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
            # cuBLASLt and torch may sum in other orders, and the fused epilogue rounds once
            torch.testing.assert_close(g, w, atol=TOL[0], rtol=TOL[1], msg=lambda m: f"{cls.__name__} {what}: {m}")


@pytest.mark.gpu
@needs_cuda_wgrad
def test_layers_cuda_backend_accumulate_into_main_grad():
    _check_layers("cuda")


def test_layers_cuda_path_on_cpu_with_emulated_op(monkeypatch):
    """Host-side logic of the cuda linear backend with the cuBLAS op emulated on CPU."""
    calls, fwd = [], []

    class Ops:
        @staticmethod
        def wgrad_accumulate(main_grad, dy, x):  # the op's contract (kernel_ops.cpp's checks)
            assert main_grad.dtype in (torch.float32, dy.dtype) and dy.dim() == x.dim() == 2
            assert dy.dtype == x.dtype and main_grad.is_contiguous()
            calls.append(tuple(main_grad.shape))
            reference.wgrad_accumulate_(main_grad, dy, x)

        @staticmethod
        def linear_fwd(x, w, bias, residual):  # the op's contract: contiguous, one dtype
            for t in (x, w, bias, residual):
                assert t is None or (t.is_contiguous() and t.dtype == x.dtype)
            fwd.append((tuple(x.shape), tuple(w.shape), bias is not None, residual is not None))
            y = torch.nn.functional.linear(x, w, bias)
            return y if residual is None else y + residual

    monkeypatch.setattr(cu_linear, "_ops", lambda: Ops)
    # the layers resolve their backend from the device; on CPU call the fused path directly
    monkeypatch.setattr("megaft.kernels.linear.resolve_backend", lambda backend, device: backend)
    monkeypatch.setattr("megaft.layers.linear.resolve_backend", lambda backend, device: backend)
    _check_layers("cpu")
    assert calls == [(40, 24)] * 3, calls  # one accumulation per layer, into the main grad
    # one GEMM per layer forward (the tokens flattened to [21, 24]): Column's bias in it;
    # Row at tp=1 takes its bias and the residual in the same GEMM (RowParallelLinear)
    assert fwd == [((21, 24), (40, 24), True, False), ((21, 24), (40, 24), True, True),
                   ((21, 24), (40, 24), False, False)], fwd  # the torch-path runs call none
    fwd.clear()
    # linear(backend="cuda"): bias and residual both reach the one GEMM; non-contiguous x is copied
    x, w, b, r = torch.randn(6, 4).t(), torch.randn(5, 6), torch.randn(5), torch.randn(4, 5)
    y = linear(x, w, b, r, backend="cuda")
    assert fwd == [((4, 6), (5, 6), True, True)], fwd
    torch.testing.assert_close(y, reference.linear(x, w, b, r))
    # without a main grad the weight gradient is returned as usual
    w = torch.randn(5, 4, requires_grad=True)
    x = torch.randn(3, 4)
    fused_linear(x, w, backend="cuda").sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(3, 5).t() @ x)
    assert calls == [(40, 24)] * 3
    with pytest.raises(ValueError, match="dy and x must share a dtype"):
        cu_linear.wgrad_accumulate_(torch.zeros(5, 4), torch.zeros(3, 5), torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a torch.bfloat16 main_grad needs dy and x of that dtype"):
        cu_linear.wgrad_accumulate_(torch.zeros(5, 4, dtype=torch.bfloat16), torch.zeros(3, 5), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="main_grad must be fp32, bf16 or fp16"):
        cu_linear.wgrad_accumulate_(torch.zeros(5, 4, dtype=torch.float64), torch.zeros(3, 5), torch.zeros(3, 4))
    # optim.master_weights: a bf16 weight whose .grad views a bf16 flat buffer, under bf16
    # autocast: the op gets that buffer and bf16 operands, and adds with one rounding
    calls.clear()
    layer = RowParallelLinear(24, 40, group=None, backend="cuda").to(torch.bfloat16)
    buf = torch.randn(layer.weight.numel(), generator=torch.Generator().manual_seed(2)).bfloat16()
    layer.weight.grad = buf.view_as(layer.weight)
    xb, dyb = torch.randn(3, 7, 24).bfloat16(), torch.randn(3, 7, 40).bfloat16()
    want = reference.wgrad_accumulate_(buf.clone().view_as(layer.weight), dyb, xb)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(xb)
    out.backward(dyb)
    assert calls == [(40, 24)] and layer.weight.grad.data_ptr() == buf.data_ptr()
    assert torch.equal(layer.weight.grad, want)  # the emulated op is the reference: nothing else added
    # an fp16 weight under bf16 autocast: cuBLAS has no bf16 A/B into an fp16 C, so the
    # weight gradient goes through autograd (the op is not called) into the same buffer
    layer = RowParallelLinear(24, 40, group=None, backend="cuda").to(torch.float16)
    buf16 = torch.zeros(layer.weight.numel(), dtype=torch.float16)
    layer.weight.grad = buf16.view_as(layer.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(xb).backward(dyb)
    assert calls == [(40, 24)] and layer.weight.grad.data_ptr() == buf16.data_ptr()
    torch.testing.assert_close(layer.weight.grad.float(), (dyb.reshape(-1, 40).t() @ xb.reshape(-1, 24)).float(),
                               rtol=1e-2, atol=1e-2)
    # a megaft._cuda built before linear_epilogue.cu: a clear error, never torch's GEMM instead
    monkeypatch.setattr(cu_linear, "_ops", lambda: type("Old", (), {})())
    with pytest.raises(RuntimeError, match="built without torch.ops.megaft.linear_fwd"):
        cu_linear.gemm(x, w)


def test_linear_fronts_on_cpu_are_torch_or_an_error():
    """Without the emulation: on CPU the fronts are the torch reference (auto) or refuse cuda."""
    x, w, b = torch.randn(3, 4), torch.randn(6, 4), torch.randn(6)
    assert torch.equal(linear(x, w, b, backend="auto"), reference.linear(x, w, b))
    assert torch.equal(linear_swiglu(x, w, b, backend="auto"), reference.linear_swiglu(x, w, b))
    for call in (lambda: linear(x, w, b, backend="cuda"), lambda: linear_swiglu(x, w, b, backend="cuda")):
        with pytest.raises(RuntimeError, match="linear backend 'cuda' is not available: tensors are on cpu"):
            call()
