"""The CUDA C++ vocab-parallel cross-entropy (csrc/cuda/cross_entropy.cu,
torch.ops.megaft.cross_entropy_*) against the torch reference, forward and backward.

GPU tests (marked `gpu`, skipped with the reason without a GPU and megaft._cuda):
- ``cross_entropy(backend="cuda")`` and ``linear_cross_entropy(backend="cuda")`` (whose
  backward writes the gradient over its recomputed logits, in place) vs the reference,
  with ignored labels, padded vocabularies, odd widths (rows not 16-byte aligned: the
  scalar path) and a strided logits view.
- tp=2 semantics in one process: two vocabulary shards' (m, s, t) combined as
  chunked.combine does over tp, each shard's gradient from the global lse.
The CPU test runs the same tp=2 protocol through the front (megaft.kernels.cross_entropy.cuda
and chunked.py's autograd) with the ops replaced by a torch emulation of the C ABI's
contract (megaft_kernels.h): it checks the front's wiring (offsets, padding, in-place
backward), not the CUDA code.

Tolerances (atol, rtol): losses are fp32 from fp32 statistics in every dtype: 1e-5 on
values of order 1-10 (online vs two-pass logsumexp reorders fp32 sums). Gradients: fp32
1e-5; half types round g * (softmax - onehot) once, like the reference, so they differ
by at most an ulp: rtol 1e-2 (bf16 has 8 bits), atol 1e-5 for the tiny probabilities.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megaft.kernels import dispatch
from megaft.kernels.cross_entropy import chunked, cross_entropy, linear_cross_entropy, reference
from megaft.kernels.cross_entropy import cuda as ce_cuda

_WHY = ("no CUDA GPU" if not torch.cuda.is_available()
        else dispatch.cuda_unavailable_reason("cross_entropy", torch.device("cuda")))
needs_cuda_ce = pytest.mark.skipif(_WHY is not None, reason=f"CUDA cross-entropy cannot run: {_WHY}")

GRAD_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-2), torch.float16: (1e-5, 2e-3)}
LOSS_TOL = (1e-5, 1e-5)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (tokens, vocab, padded): tails, odd widths (unaligned rows), a padded shard, model-sized rows
SHAPES = [(1, 5, 5), (37, 123, 124), (64, 1000, 1000), (20, 33, 40), (9, 32000, 32000), (3, 50257, 50264)]


def _data(n, vocab, padded, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, padded, generator=gen)
    logits[:, vocab:] = 1e4  # padding must never count, however large
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::4] = -100
    grad = torch.rand(n, generator=gen) + 0.5
    return logits.to(device, dtype), labels.to(device), grad.to(device)


def _want(logits, labels, grad, vocab):
    """Per-token loss and d logits of F.cross_entropy over the real columns, in fp32."""
    x = logits.detach().float()[:, :vocab].requires_grad_()
    loss = F.cross_entropy(x, labels, ignore_index=-100, reduction="none")
    loss.backward(grad)
    dx = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    dx[:, :vocab] = x.grad
    return loss.detach(), dx.to(logits.dtype)


def _close(got, want, tol, name):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {got.dtype} {got.shape}"
    torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1], msg=lambda m: f"{name}: {m}")


def _two_shards(logits, labels, grad, vocab, stats, grad_fn, inplace=False):
    """tp=2 in one process: each half of the (padded) vocabulary is a rank's shard; the
    statistics are combined as chunked.combine does with its all-reduces."""
    local = logits.shape[1] // 2
    parts = []
    for rank in range(2):
        shard = logits[:, rank * local:(rank + 1) * local].contiguous()
        n_real = max(0, min(local, vocab - rank * local))
        parts.append((shard, rank * local, n_real, stats(shard, labels, rank * local, n_real)))
    big = torch.maximum(parts[0][3][0], parts[1][3][0])
    s = sum(p[3][1] * (p[3][0] - big).exp() for p in parts)
    t = sum(p[3][2] for p in parts)
    lse = big + s.log()
    loss = torch.where(labels != -100, lse - t, torch.zeros_like(lse))
    g = (grad * (labels != -100)).float()
    kw = {"inplace": True} if inplace else {}
    dx = torch.cat([grad_fn(shard, labels, lse, g, start, n_real, **kw) for shard, start, n_real, _ in parts], 1)
    return loss, dx


@pytest.mark.gpu
@needs_cuda_ce
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_cuda(shape, dtype):
    n, vocab, padded = shape
    logits, labels, grad = _data(n, vocab, padded, dtype, "cuda")
    want_loss, want_dx = _want(logits, labels, grad, vocab)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, labels, vocab_size=vocab, backend="cuda")
    loss.backward(grad)
    _close(loss, want_loss, LOSS_TOL, "loss")
    _close(x.grad, want_dx, GRAD_TOL[dtype], "dlogits")
    assert torch.equal(x.detach(), logits), "the logits must not be modified"
    # tp=2: the shards' statistics and gradients, combined as over a tp group
    if padded % 2 == 0:
        for inplace in (False, True):
            loss2, dx2 = _two_shards(logits.clone(), labels, grad, vocab, ce_cuda.stats, ce_cuda.grad, inplace)
            _close(loss2, want_loss, LOSS_TOL, f"tp2 loss (inplace={inplace})")
            _close(dx2, want_dx, GRAD_TOL[dtype], f"tp2 dlogits (inplace={inplace})")


@pytest.mark.gpu
@needs_cuda_ce
def test_cross_entropy_cuda_strided_and_inplace():
    # A column slice: rows are strided (and not 16-byte aligned), the front makes it contiguous.
    logits, labels, grad = _data(33, 301, 301, torch.bfloat16, "cuda")
    wide = torch.zeros(33, 310, dtype=torch.bfloat16, device="cuda")
    wide[:, 3:304] = logits
    view = wide[:, 3:304]
    m, s, t = ce_cuda.stats(view, labels, 0, 301)  # the op itself takes a row stride
    want_loss, want_dx = _want(logits, labels, grad, 301)
    lse = m + s.log()
    _close(torch.where(labels != -100, lse - t, torch.zeros_like(lse)), want_loss, LOSS_TOL, "strided loss")
    g = grad * (labels != -100)
    _close(ce_cuda.grad(view, labels, lse, g, 0, 301), want_dx, GRAD_TOL[torch.bfloat16], "strided dlogits")
    same = logits.clone()
    out = ce_cuda.grad(same, labels, lse, g, 0, 301, inplace=True)
    assert out.data_ptr() == same.data_ptr()
    _close(same, want_dx, GRAD_TOL[torch.bfloat16], "in-place dlogits")


@pytest.mark.gpu
@needs_cuda_ce
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_cross_entropy_cuda(dtype):
    n, d, vocab = 45, 32, 1003
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, d, generator=gen).to("cuda", dtype)
    weight = (torch.randn(vocab, d, generator=gen) / d ** 0.5 * 3).to("cuda", dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen).cuda()
    labels[::5] = -100
    grad = (torch.rand(n, generator=gen) + 0.5).cuda()
    outs = {}
    for name, fn in (("ref", lambda h, w: reference.linear_cross_entropy(h, w, labels, group=None, vocab_start=0,
                                                                        vocab_size=vocab)),
                     ("cuda", lambda h, w: linear_cross_entropy(h, w, labels, backend="cuda", chunk=16))):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward(grad)
        outs[name] = (loss.detach(), h.grad, w.grad)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)  # bf16: the logits matmul rounds
    for what, g, w in zip(("loss", "dhidden", "dweight"), outs["cuda"], outs["ref"]):
        if dtype == torch.float32:
            _close(g, w, (1e-4, 1e-4) if what != "loss" else LOSS_TOL, what)  # chunked fp32 weight sums
        else:
            err = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert err <= tol[1], f"{what}: relative error {err:.2e}"


class _EmulatedOps:
    """The C ABI's contract (megaft_kernels.h) in torch, to run the front on CPU."""

    @staticmethod
    def cross_entropy_fwd(x, labels, vocab_start, n_real):
        assert labels.dtype == torch.int64 and x.dim() == 2
        return chunked._torch_stats(x, labels, vocab_start, n_real)

    @staticmethod
    def cross_entropy_bwd(x, labels, lse, g, vocab_start, n_real):
        assert lse.dtype == g.dtype == torch.float32
        return chunked._torch_grad(x, labels, lse, g, vocab_start, n_real)

    @classmethod
    def cross_entropy_bwd_(cls, x, labels, lse, g, vocab_start, n_real):
        x.copy_(cls.cross_entropy_bwd(x, labels, lse, g, vocab_start, n_real))
        _EmulatedOps.inplace_calls += 1
        return x

    inplace_calls = 0


def test_cuda_front_on_cpu_with_emulated_ops(monkeypatch):
    """Host-side logic only: the front's tp=2 protocol and chunked.py's cuda wiring, with
    the two ops emulated (the CUDA code itself runs in the gpu tests above)."""
    monkeypatch.setattr(ce_cuda, "_ops", lambda: _EmulatedOps)
    n, vocab, padded = 29, 77, 80  # rank 1 holds 3 padded columns
    logits, labels, grad = _data(n, vocab, padded, torch.float32, "cpu")
    want_loss, want_dx = _want(logits, labels, grad, vocab)
    for inplace in (False, True):
        loss, dx = _two_shards(logits.clone(), labels.int(), grad, vocab, ce_cuda.stats, ce_cuda.grad, inplace)
        _close(loss, want_loss, LOSS_TOL, "tp2 loss")
        _close(dx, want_dx, GRAD_TOL[torch.float32], "tp2 dlogits")
    # chunked.py's autograd with backend "cuda" (dispatch bypassed: it needs CUDA tensors)
    x = logits.clone().requires_grad_()
    loss = chunked.CrossEntropy.apply(x, labels, None, 0, vocab, "cuda")
    loss.backward(grad)
    _close(loss, want_loss, LOSS_TOL, "loss")
    _close(x.grad, want_dx, GRAD_TOL[torch.float32], "dlogits")
    # the fused linear cross-entropy overwrites its recomputed logits chunks in place
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(n, 16, generator=gen), torch.randn(vocab, 16, generator=gen) / 4
    before = _EmulatedOps.inplace_calls
    got, want = [], []
    for impl, out in (("cuda", got), ("torch", want)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = chunked.LinearCrossEntropy.apply(h, w, labels, None, 0, vocab, impl, 8)
        loss.backward(grad)
        out += [loss.detach(), h.grad, w.grad]
    assert _EmulatedOps.inplace_calls - before == math.ceil(n / 8)
    for what, g, w in zip(("loss", "dhidden", "dweight"), got, want):
        _close(g, w, (1e-6, 1e-6), what)
