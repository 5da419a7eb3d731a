"""Cross-entropy kernels against the reference, forward and backward, at tp=1 and tp=2.

Every backend of ``cross_entropy`` (logits -> loss) and of ``linear_cross_entropy``
(hidden, head weight -> loss, chunked over tokens) is compared with
``reference.cross_entropy`` / ``reference.linear_cross_entropy``: per-token losses, the
logits / hidden / weight gradients, under a non-uniform upstream gradient, with ignored
labels (-100), padded vocabularies and odd sizes.

Tolerances (atol, rtol):
- fp32: 1e-5. Same math; the online logsumexp, the tp combine (s * exp(m - M)) and the
  chunked weight-gradient sum only reorder fp32 sums.
- bf16: 1e-2 relative (the usual); atol 1e-2. The reference's logits are bf16 too (its
  matmul rounds them); both compute the softmax in fp32 and round the gradient once,
  so differences are a few bf16 ulps.
"""

from __future__ import annotations

import pytest
import torch
from multirank import spawn
from torch.utils._python_dispatch import TorchDispatchMode

from megaft.kernels import _triton
from megaft.kernels.cross_entropy import cross_entropy, linear_cross_entropy, reference, resolve_backend

DTYPES = [pytest.param(torch.float32, (1e-5, 1e-5), id="fp32"),
          pytest.param(torch.bfloat16, (1e-2, 1e-2), id="bf16")]
# (tokens, hidden, vocab, padded vocab): tails, non-powers of two, one padded column
SHAPES = [(1, 8, 5, 5), (37, 24, 123, 123), (64, 16, 300, 320), (20, 8, 33, 34)]


def _triton_reason():
    return _triton.unavailable_reason(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    _triton_reason() is not None, reason=f"triton cannot run here: {_triton_reason()}"))]


def _inputs(n, d, vocab, padded, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(padded, d, generator=gen) / d ** 0.5 * 3
    weight[vocab:] = 0.0  # padded rows, as the head keeps them
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::4] = -100  # ignored tokens
    grad = torch.rand(n, generator=gen) + 0.5  # non-uniform per-token upstream gradient
    return hidden.to(device, dtype), weight.to(device, dtype), labels.to(device), grad.to(device)


def _grads(fn, tensors, grad):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    loss = fn(*leaves)
    loss.backward(grad)
    return loss.detach(), [t.grad for t in leaves]


def _close(got, want, tol, name):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    torch.testing.assert_close(got.float(), want.float(), atol=tol[0], rtol=tol[1], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_cross_entropy_matches_reference(shape, dtype, tol, backend):
    n, d, vocab, padded = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, weight, labels, grad = _inputs(n, d, vocab, padded, dtype, device)
    logits = hidden @ weight.t()
    kw = dict(group=None, vocab_start=0, vocab_size=vocab)
    want, (want_dx,) = _grads(lambda x: reference.cross_entropy(x, labels, **kw), [logits], grad)
    got, (got_dx,) = _grads(lambda x: cross_entropy(x, labels, backend=backend, **kw), [logits], grad)
    _close(got, want, tol, "loss")
    _close(got_dx, want_dx, tol, "dlogits")
    assert (got[labels == -100] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_linear_cross_entropy_matches_reference(shape, dtype, tol, chunk, backend):
    n, d, vocab, padded = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, weight, labels, grad = _inputs(n, d, vocab, padded, dtype, device)
    kw = dict(group=None, vocab_start=0, vocab_size=vocab)
    want, want_g = _grads(lambda h, w: reference.linear_cross_entropy(h, w, labels, **kw), [hidden, weight], grad)
    got, got_g = _grads(lambda h, w: linear_cross_entropy(h, w, labels, backend=backend, chunk=chunk, **kw),
                        [hidden, weight], grad)
    _close(got, want, tol, "loss")
    for name, g, w in zip(("dhidden", "dweight"), got_g, want_g):
        if dtype == torch.bfloat16 and name == "dweight":
            # a sum over all tokens: compare as a whole, ||got - want|| / ||want||
            err = ((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)).item()
            assert err <= tol[1], f"dweight: relative error {err:.2e}"
            continue
        _close(g, w, tol, name)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_linear_cross_entropy_never_materializes_all_logits():
    """Forward + backward of the fused path: no intermediate larger than one chunk's
    logits (or the weight/hidden-sized gradients), while the unfused path builds all
    [N, V] logits (fp32 copy, softmax and gradient included)."""
    n, d, vocab, chunk = 256, 16, 500, 32
    hidden, weight, labels, grad = _inputs(n, d, vocab, vocab, torch.float32)
    kw = dict(group=None, vocab_start=0, vocab_size=vocab)
    sizes = {}
    for name, fn in (("unfused", lambda h, w: reference.linear_cross_entropy(h, w, labels, **kw)),
                     ("fused", lambda h, w: linear_cross_entropy(h, w, labels, backend="torch", chunk=chunk, **kw))):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with _LargestTensor() as mode:
            fn(h, w).backward(grad)
        sizes[name] = mode.largest
    assert sizes["unfused"] >= n * vocab
    assert sizes["fused"] <= max(chunk * vocab, vocab * d, n * d), sizes
    assert sizes["fused"] * 4 <= sizes["unfused"], sizes  # the 1/4 bound, by construction here


def test_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    with pytest.raises(RuntimeError, match="cross_entropy backend 'cuda' is not available: tensors are on cpu"):
        resolve_backend("cuda", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="cross_entropy backend 'triton' is not available"):
        cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), backend="triton")
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_cross_entropy(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long), chunk=0)


def _tp2_rank(rank: int, world: int, backends: list[str]) -> None:
    """Each rank holds half of the (padded) vocabulary; losses, the summed hidden grad
    and this rank's weight-grad rows must equal the full single-process reference."""
    import torch.distributed as dist

    from megaft.parallel.tensor.comm import copy_to_tp

    group = dist.group.WORLD
    failures = []
    for n, d, vocab, padded in [(37, 24, 123, 124), (20, 8, 33, 40)]:  # 40: rank 1 holds 7 padded rows
        hidden, weight, labels, grad = _inputs(n, d, vocab, padded, torch.float32)
        want, (want_h, want_w) = _grads(lambda h, w: reference.linear_cross_entropy(
            h, w, labels, group=None, vocab_start=0, vocab_size=vocab), [hidden, weight], grad)
        local = padded // world
        rows = slice(rank * local, (rank + 1) * local)
        kw = dict(group=group, vocab_start=rank * local, vocab_size=vocab)
        for backend in backends:
            cases = {
                "ce": lambda h, w: cross_entropy(copy_to_tp(h, group) @ w.t(), labels, backend=backend, **kw),
                "linear_ce": lambda h, w: linear_cross_entropy(copy_to_tp(h, group), w, labels, backend=backend,
                                                               chunk=8, **kw),
            }
            for name, fn in cases.items():
                got, (got_h, got_w) = _grads(fn, [hidden, weight[rows]], grad)
                for what, g, w in (("loss", got, want), ("dhidden", got_h, want_h), ("dweight", got_w, want_w[rows])):
                    try:
                        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
                    except AssertionError as e:
                        failures.append(f"{name}/{backend} {(n, d, vocab, padded)} {what}: {e}")
    assert not failures, "\n".join(failures)


def test_tp2_matches_single_process():
    backends = ["torch"] + (["triton"] if _triton.unavailable_reason(torch.device("cpu")) is None else [])
    spawn(2, _tp2_rank, backends)



def test_linear_cross_entropy_under_autocast():
    """Under bf16 autocast the fused path recomputes its logits with the forward's
    rounding, so it tracks the unfused bf16 pair (fp32 hidden and weight, as in the model)."""
    hidden, weight, labels, grad = _inputs(40, 16, 50, 50, torch.float32)
    kw = dict(group=None, vocab_start=0, vocab_size=50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_g = _grads(lambda h, w: reference.linear_cross_entropy(h, w, labels, **kw), [hidden, weight], grad)
        got, got_g = _grads(lambda h, w: linear_cross_entropy(h, w, labels, backend="torch", chunk=7, **kw),
                            [hidden, weight], grad)
    _close(got, want, (1e-2, 1e-2), "loss")
    for name, g, w in zip(("dhidden", "dweight"), got_g, want_g):
        err = ((g - w).norm() / w.norm()).item()
        assert err <= 1e-2, f"{name}: relative error {err:.2e}"
