"""AdamW: the reference and every backend against torch.optim.AdamW(foreach=False).

Tolerances (fp32):
- reference.py vs torch: exact. It runs the same torch ops in the same order.
- megaft._C vs torch: exp_avg and exp_avg_sq exact on AVX2/AVX-512 torch builds
  (torch's vectorized lerp/addcmul use one fma each, like our kernel). param differs
  because torch's CPU sqrt comes from MKL (up to 1 ulp off) while ours is IEEE:
  a 1-ulp denom changes one update (~lr) by ~lr*2^-23, so we allow 1e-6 (8 ulps)
  of the largest |p| the element held (p0 or its end: an update's rounding is
  relative to the param it was added to) and 1e-6*lr (a millionth of a step),
  which a wrong formula (missing bias correction, eps placement, decay) far exceeds.
  Under torch's scalar kernels (ATEN_CPU_CAPABILITY=default) exp_avg and exp_avg_sq
  differ by rounding too: 8 ulps of the largest gradient (its square) they summed.
- megaft._C vs the reference with a correctly rounded sqrt: exact.
"""

from __future__ import annotations

import pytest
import torch

from megaft.kernels import _ext
from megaft.kernels.adamw import adamw_step_, reference, resolve_backend

# exact: make test runs these on the pinned CPU code path; native: and on this CPU's own kernels too, where
# torch's vectorized lerp/addcmul use fma and the cpu backend must equal them bitwise (docs/contributing.md)
pytestmark = [pytest.mark.exact, pytest.mark.native]

# 1 and 7: tails only; 4099: vector body + tail; 100_003: several at::parallel_for
# chunks (grain 32768) split at odd offsets; 1_000_003: large, still fast.
SIZES = [1, 7, 4099, 100_003, 1_000_003]
HPARAMS = [
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),  # the usual
    dict(lr=0.1, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0),  # no decay
    dict(lr=3e-4, beta1=0.3, beta2=0.95, eps=1e-8, weight_decay=0.1),  # lerp's 1-b1 >= .5 branch
    dict(lr=1.0, beta1=0.0, beta2=0.5, eps=1e-3, weight_decay=0.5),  # extremes
]
# Several steps with gradients of different scales, so bias correction and the
# history in exp_avg_sq both matter.
GRAD_SCALES = (1.0, 0.1, 3.0, 1e-3, 1.0)
FMA_TORCH = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def make_case(n: int, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * s for s in GRAD_SCALES]
    return p0.to(device), [g.to(device) for g in grads]


def run_torch_adamw(p0, grads, hp):
    """torch.optim.AdamW on one parameter; returns (param, exp_avg, exp_avg_sq)."""
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]),
                            eps=hp["eps"], weight_decay=hp["weight_decay"], foreach=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


def run_step_fn(step_fn, p0, grads, hp):
    """Our step functions from zero state; returns (param, exp_avg, exp_avg_sq)."""
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, g in enumerate(grads, start=1):
        step_fn(p, g, m, v, step=step, **hp)
    return p, m, v


def reference_ieee_sqrt(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
                        weight_decay):
    """reference.py with torch's MKL sqrt swapped for a correctly rounded one
    (double sqrt rounded to float), the only op where megaft._C may differ."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.double().sqrt().float() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def assert_close_to_scale(got, want, scale, what: str, atol: float = 0.0):
    """|got - want| <= 1e-6 (8 ulps) of `scale` + atol, element by element: a sum's rounding is
    relative to the largest term it added, not to its result (issue 44: under torch's scalar
    kernels, ATEN_CPU_CAPABILITY=default, elements that end near 0 after cancelling terms were
    1.4e-7 off, beyond 8 ulps of their own end value)."""
    if got.numel() == 0:
        return
    bound = 1e-6 * scale + atol
    worst = int(((got - want).abs() / bound).argmax())
    assert (got - want).abs()[worst] <= bound[worst], \
        f"{what}[{worst}]: {got[worst].item()} against {want[worst].item()}, bound {bound[worst].item()}"


def assert_param_close(p, p_ref, p0, lr):
    """8 ulps of the largest magnitude the element held (p0 or its end value; the steps of ~lr
    in between were added to it) and a millionth of a step."""
    assert_close_to_scale(p, p_ref, torch.maximum(p0.abs(), p_ref.abs()), "param", atol=1e-6 * lr)


def cpu_backend(*args, **kw):
    adamw_step_(*args, backend="cpu", **kw)


@pytest.fixture
def three_threads():
    """tests/conftest.py pins torch to 1 thread; use 3 so at::parallel_for splits
    large tensors at offsets that are not multiples of the vector width."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def test_cpu_extension_is_built():
    # megaft._C is always built by setup.py; its absence is a broken install.
    assert _ext.C.available, _ext.C.error
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("hp", HPARAMS)
@pytest.mark.parametrize("n", SIZES)
def test_reference_equals_torch_adamw(n, hp):
    p0, grads = make_case(n)
    expected = run_torch_adamw(p0, grads, hp)
    got = run_step_fn(reference.adamw_step_, p0, grads, hp)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, expected):
        assert torch.equal(a, b), f"{name} differs from torch.optim.AdamW"


@pytest.mark.parametrize("hp", HPARAMS)
@pytest.mark.parametrize("n", SIZES)
def test_cpu_matches_torch_adamw(n, hp, three_threads):
    p0, grads = make_case(n, seed=n)
    p_ref, m_ref, v_ref = run_torch_adamw(p0, grads, hp)
    p, m, v = run_step_fn(cpu_backend, p0, grads, hp)
    assert_param_close(p, p_ref, p0, hp["lr"])
    if FMA_TORCH:
        assert torch.equal(m, m_ref) and torch.equal(v, v_ref)
    else:  # torch's scalar lerp/addcmul round twice where we round once: ulps of the largest term summed
        biggest = torch.stack(grads).abs().amax(0)  # m mixes the gradients (which may cancel), v their squares
        assert_close_to_scale(m, m_ref, torch.maximum(m_ref.abs(), biggest), "exp_avg")
        assert_close_to_scale(v, v_ref, torch.maximum(v_ref.abs(), biggest.square()), "exp_avg_sq")


@pytest.mark.skipif(not FMA_TORCH, reason="torch's CPU kernels use fma only on AVX2/AVX-512")
@pytest.mark.parametrize("hp", HPARAMS)
@pytest.mark.parametrize("n", SIZES)
def test_cpu_bitwise_equals_reference_with_ieee_sqrt(n, hp, three_threads):
    p0, grads = make_case(n, seed=n + 1)
    expected = run_step_fn(reference_ieee_sqrt, p0, grads, hp)
    got = run_step_fn(cpu_backend, p0, grads, hp)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, expected):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} elements differ"


@pytest.mark.parametrize("bad, match", [
    (lambda t: t.double(), "float32"),
    (lambda t: t.view(2, -1).t(), "contiguous"),
    (lambda t: t[:-1].clone(), "shape"),
])
def test_cpu_rejects_bad_grad(bad, match):
    p, m, v = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    with pytest.raises(RuntimeError, match=match):
        cpu_backend(p, bad(torch.ones(64)), m, v, step=1, **HPARAMS[0])


def test_cpu_rejects_aliasing_and_bad_step():
    p, g, m = torch.zeros(64), torch.ones(64), torch.zeros(64)
    with pytest.raises(RuntimeError, match="distinct"):
        cpu_backend(p, g, m, m, step=1, **HPARAMS[0])
    with pytest.raises(RuntimeError, match="step counts from 1"):
        cpu_backend(p, g, m, torch.zeros(64), step=0, **HPARAMS[0])


def test_auto_logs_its_choice_once(monkeypatch, caplog):
    import megaft.kernels.adamw as adamw

    monkeypatch.setattr(adamw, "_logged", set())
    p, g, m, v = torch.zeros(8), torch.ones(8), torch.zeros(8), torch.zeros(8)
    with caplog.at_level("INFO", logger=adamw.__name__):
        for step in (1, 2):
            adamw_step_(p, g, m, v, step=step, **HPARAMS[0])
    assert [r.getMessage() for r in caplog.records] == ["adamw backend=auto on cpu: using 'cpu'"]


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("tpu", torch.device("cpu"))


@pytest.mark.skipif(_ext.CUDA.available, reason="megaft._cuda is built here")
def test_explicit_unavailable_backend_raises_with_cause_and_fix():
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    with pytest.raises(RuntimeError) as info:
        adamw_step_(p, g, m, v, step=1, backend="cuda", **HPARAMS[0])
    msg = str(info.value)
    assert "backend 'cuda'" in msg and "megaft._cuda" in msg
    assert _ext.CUDA.error in msg  # the original ImportError text, apex-style
    assert "MEGAFT_CUDA=1" in msg and "--no-build-isolation" in msg
    assert torch.equal(p, torch.zeros(8)), "nothing may run after the error"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hp", HPARAMS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1])  # 1: pointers not 16-byte aligned, scalar path
def test_cuda_matches_cpu_and_torch(n, hp, offset):
    assert _ext.CUDA.available, _ext.CUDA.error
    p0, grads = make_case(n, seed=n + 2)

    def cuda_backend(p, g, m, v, **kw):
        # Misaligned views: same values, storage shifted by `offset` floats.
        views = []
        for t in (p, g, m, v):
            buf = torch.empty(n + offset, device="cuda")
            buf[offset:] = t
            views.append(buf[offset:])
        adamw_step_(*views, backend="cuda", **kw)
        for t, view in zip((p, m, v), (views[0], views[2], views[3])):
            t.copy_(view)

    got = run_step_fn(cuda_backend, p0.cuda(), [g.cuda() for g in grads], hp)
    # Both kernels round every op IEEE-correctly in the same order: bitwise equal.
    cpu = run_step_fn(cpu_backend, p0, grads, hp)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, cpu):
        assert torch.equal(a.cpu(), b), f"{name} differs from megaft._C"
    # torch's CUDA AdamW divides by multiplying with a reciprocal: same tolerance as CPU.
    p_ref, _, _ = run_torch_adamw(p0.cuda(), [g.cuda() for g in grads], hp)
    assert_param_close(got[0].cpu(), p_ref.cpu(), p0, hp["lr"])
