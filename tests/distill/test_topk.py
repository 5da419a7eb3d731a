"""megaft.distill.topk: the teacher's top-k per target token and the divergence against it.

- teacher_topk equals torch.topk of the dense log_softmax, and its tail the log of the rest's mass;
- topk_divergence equals a hand-written fp64 reference (the k ids and the tail as one bucket, the
  generalized JSD written out), loss and the student logits' gradient, at k = 1, 8, 64;
- at k = vocabulary it equals the full-vocabulary token_divergence (loss and gradient);
- it grows with k toward the full loss, never above it (the data-processing inequality);
- under tp2 (the vocabulary split, the last slice ending in a padding column or padding only) both
  equal the single process.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megaft.distill.losses import token_divergence
from megaft.distill.topk import TopK, teacher_topk, topk_divergence
from tests.multirank import spawn

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)

B, S, V = 3, 7, 101  # odd vocabulary: under tp2 the second slice holds 50 real columns of 51
KS = (1, 8, 64)
CASES = list(itertools.product([0.0, 0.5, 1.0], [1.0, 2.0]))


def _inputs(seed: int = 0):
    """Seeded logits of spread 3 (peaked enough that the top-k hold most of the teacher's mass)."""
    g = torch.Generator().manual_seed(seed)
    student = (3 * torch.randn(B, S, V, generator=g, dtype=torch.float64)).float()
    teacher = (3 * torch.randn(B, S, V, generator=g, dtype=torch.float64)).float()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[2, 5:] = -100  # padding
    return student, teacher, labels


def _rows(x, labels):
    return x.reshape(-1, x.shape[-1])[(labels.reshape(-1) != -100)]


def _hand(student, teacher, labels, k, beta, temperature):
    """The definition written out in fp64: the teacher's k most likely ids and one tail bucket, each
    model's probabilities summed into those k + 1 outcomes, then the generalized JSD term by term."""
    p = torch.softmax(_rows(teacher, labels).double() / temperature, -1)
    q = torch.softmax(_rows(student, labels).double() / temperature, -1)
    ids = p.topk(k, -1).indices
    pk, qk = p.gather(1, ids), q.gather(1, ids)
    P = torch.cat([pk, (1 - pk.sum(-1, keepdim=True)).clamp_min(0)], -1)
    Q = torch.cat([qk, (1 - qk.sum(-1, keepdim=True)).clamp_min(0)], -1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum(-1)
    if beta == 0:
        return kl(P, Q)
    if beta == 1:
        return kl(Q, P)
    M = beta * P + (1 - beta) * Q
    return beta * kl(P, M) + (1 - beta) * kl(Q, M)


def _mine(student, teacher, labels, k, beta, temperature, chunk=1024):
    """(loss averaged over the target tokens, the student's gradient) of topk_divergence."""
    top = teacher_topk(_rows(teacher, labels), k, temperature=temperature)
    s = student.clone().requires_grad_()
    per_token = topk_divergence(s, top, labels, beta=beta, temperature=temperature, chunk=chunk)
    loss = per_token.sum() / (labels != -100).sum()
    loss.backward()
    assert (per_token[labels == -100] == 0).all()
    return loss.detach(), s.grad


def test_teacher_topk_is_the_dense_topk():
    _, teacher, labels = _inputs()
    rows = _rows(teacher, labels)
    for k, temperature in itertools.product(KS + (V,), [1.0, 2.0]):
        top = teacher_topk(rows, k, temperature=temperature)
        dense = torch.log_softmax(rows.double() / temperature, -1)
        want = dense.topk(k, -1)
        assert torch.equal(top.ids, want.indices)
        # fp32 log-softmax against fp64: a few ulps of values up to ~|30|
        torch.testing.assert_close(top.logps.double(), want.values, rtol=0, atol=1e-5)
        rest = dense.exp().sum(-1) - want.values.exp().sum(-1)
        if k == V:
            assert (top.tail == float("-inf")).all()
        else:
            torch.testing.assert_close(top.tail.double(), rest.log(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("beta,temperature", CASES)
@pytest.mark.parametrize("chunk", [1024, 4])
def test_equals_the_hand_reference(beta, temperature, chunk):
    student, teacher, labels = _inputs()
    n = (labels != -100).sum()
    for k in KS:
        leaf = student.clone().requires_grad_()
        want = _hand(leaf, teacher, labels, k, beta, temperature).sum() / n
        want.backward()
        loss, grad = _mine(student, teacher, labels, k, beta, temperature, chunk)
        assert want > 1e-3 and grad.abs().max() > 0
        # fp32 against fp64: the terms are probabilities times log-ratios of magnitude up to ~30, whose fp32
        # rounding (~30 x 6e-8 = 2e-6 relative to 1) bounds the loss's and, against the largest element,
        # the gradient's error (5e-6 of the largest element measured)
        torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, leaf.grad.float(), rtol=1e-4, atol=2e-5 * leaf.grad.abs().max().item())


@pytest.mark.parametrize("beta,temperature", CASES)
def test_at_the_whole_vocabulary_equals_the_full_loss(beta, temperature):
    student, teacher, labels = _inputs(1)
    s = student.clone().requires_grad_()
    full = token_divergence(s, teacher, labels, beta=beta, temperature=temperature)
    full = full.sum() / (labels != -100).sum()
    full.backward()
    loss, grad = _mine(student, teacher, labels, V, beta, temperature)
    # the same fp32 terms summed in another order (sorted by the teacher's probability): a few ulps
    torch.testing.assert_close(loss, full.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(grad, s.grad, rtol=1e-5, atol=1e-7 * s.grad.abs().max().item())


def test_grows_with_k_toward_the_full_loss():
    """Per token, D_1 <= D_8 <= D_64 <= D_V = full (coarsening never increases an f-divergence)."""
    student, teacher, labels = _inputs(2)
    mask = labels != -100
    for beta, temperature in CASES:
        full = token_divergence(student, teacher, labels, beta=beta, temperature=temperature)[mask]
        prev = torch.zeros_like(full)
        for k in KS + (V,):
            top = teacher_topk(_rows(teacher, labels), k, temperature=temperature)
            d = topk_divergence(student, top, labels, beta=beta, temperature=temperature)[mask]
            # rounding of O(1) fp32 sums; the steps between k's are far larger
            assert (d >= prev - 1e-5).all() and (d <= full + 1e-5).all(), (beta, temperature, k)
            prev = d
        torch.testing.assert_close(prev, full, rtol=2e-6, atol=1e-6)
        assert full.sum() > prev.new_tensor(0)


def _tp_rank(rank: int, world: int):
    group = torch.distributed.group.WORLD
    student, teacher, labels = _inputs(3)
    failures = []
    # padded vocabularies: one padding column at the end of the last slice (pad 1), or a last slice of padding
    # only (pad V: a small vocabulary padded to Megatron's 128 x tp)
    for (beta, temperature), k, chunk, pad in itertools.product(CASES, KS + (V,), [1024, 5], [1, V]):
        width = (V + pad) // world

        def fill(x):
            return torch.cat([x, torch.randn(B, S, pad)], -1)[..., rank * width:(rank + 1) * width]
        rows = _rows(teacher, labels)
        want_top = teacher_topk(rows, k, temperature=temperature)
        want_loss, want_grad = _mine(student, teacher, labels, k, beta, temperature, chunk)
        top = teacher_topk(_rows(fill(teacher), labels), k, temperature=temperature, group=group, vocab_size=V)
        s = fill(student).clone().requires_grad_()
        per_token = topk_divergence(s, want_top, labels, beta=beta, temperature=temperature, group=group,
                                    vocab_size=V, chunk=chunk)
        loss = per_token.sum() / (labels != -100).sum()
        loss.backward()
        mine = want_grad[..., min(rank * width, V):min((rank + 1) * width, V)]
        try:
            assert torch.equal(top.ids, want_top.ids)
            # the log-softmax's normaliser summed over two slices: a few ulps
            torch.testing.assert_close(top.logps, want_top.logps, rtol=0, atol=1e-5)
            torch.testing.assert_close(top.tail, want_top.tail, rtol=0, atol=1e-5)
            torch.testing.assert_close(loss, want_loss, rtol=2e-6, atol=1e-7)
            # the gradient's terms are probabilities times log-ratios up to ~30, and a tail column's is a difference
            # of two of them: fp32 rounding of the normaliser summed over two slices (30 x 1.2e-7 = 3.6e-6 a
            # term, over k + 1 terms) against the largest element (1.0e-5 of it measured; a lost or doubled
            # slice's share would be O(1))
            torch.testing.assert_close(s.grad[..., :mine.shape[-1]], mine, rtol=1e-5,
                                       atol=1e-4 * want_grad.abs().max().item())
            assert (s.grad[..., mine.shape[-1]:] == 0).all()  # the padding column: no gradient
        except AssertionError as e:
            failures.append(f"beta={beta} T={temperature} k={k} chunk={chunk} pad={pad}: {e}")
    assert not failures, "\n".join(failures)


def test_tp2_vocab_parallel_equals_one_process():
    spawn(2, _tp_rank)


def test_a_count_mismatch_is_refused():
    student, teacher, labels = _inputs()
    top = teacher_topk(_rows(teacher, labels)[:-1], 8)
    with pytest.raises(ValueError, match="target tokens"):
        topk_divergence(student, TopK(*top), labels, beta=0.5)
