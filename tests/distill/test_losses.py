"""megaft.distill.losses.token_divergence equals TRL 1.16's GKDTrainer.generalized_jsd_loss (the
installed function itself): the loss and the student logits' gradient, for beta in {0, 0.5, 1} and
temperature in {1, 2}, in one chunk or several, and under tp2 with the vocabulary split (each rank
its slice of both models' logits, padding columns past the true vocabulary dropped)."""
from __future__ import annotations

import itertools

import pytest
import torch

from megaft.distill.losses import token_divergence
from tests.multirank import spawn

trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
CASES = list(itertools.product([0.0, 0.5, 1.0], [1.0, 2.0]))
B, S, V = 3, 7, 37  # odd vocabulary: under tp2 the second slice holds 18 real columns of 19


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = (2 * torch.randn(B, S, V, generator=g, dtype=torch.float64)).float()
    teacher = (2 * torch.randn(B, S, V, generator=g, dtype=torch.float64)).float()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[2, 5:] = -100  # padding
    return student, teacher, labels


def _trl(student, teacher, labels, beta, temperature):
    """TRL's loss (batchmean: over the target tokens) and the student's gradient."""
    s = student.clone().requires_grad_()
    loss = trl_gkd.GKDTrainer.generalized_jsd_loss(s, teacher, labels, beta=beta, temperature=temperature)
    loss.backward()
    return loss.detach(), s.grad


@pytest.mark.parametrize("beta,temperature", CASES)
@pytest.mark.parametrize("chunk", [1024, 4])
def test_equals_trl_generalized_jsd(beta, temperature, chunk):
    student, teacher, labels = _inputs()
    want_loss, want_grad = _trl(student, teacher, labels, beta, temperature)
    s = student.clone().requires_grad_()
    per_token = token_divergence(s, teacher, labels, beta=beta, temperature=temperature, chunk=chunk)
    n = (labels != -100).sum()
    loss = per_token.sum() / n
    loss.backward()
    assert want_loss > 1e-3 and want_grad.abs().sum() > 0
    assert (per_token[labels == -100] == 0).all()
    # the same fp32 expressions; only the log-softmax's (max, log sum exp) path and the sums' order
    # differ: a few ulps of O(1) values
    torch.testing.assert_close(loss, want_loss, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(s.grad, want_grad, rtol=1e-5, atol=1e-8)


def test_beta_ends_are_the_two_kls():
    """beta 0 is KL(teacher || student), beta 1 KL(student || teacher), from log_softmax by hand."""
    student, teacher, labels = _inputs(1)
    s, t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    mask = labels != -100
    forward = (t.exp() * (t - s)).sum(-1)[mask]
    reverse = (s.exp() * (s - t)).sum(-1)[mask]
    torch.testing.assert_close(token_divergence(student, teacher, labels, beta=0.0)[mask], forward)
    torch.testing.assert_close(token_divergence(student, teacher, labels, beta=1.0)[mask], reverse)
    assert not torch.allclose(forward, reverse)


def _tp_rank(rank: int, world: int):
    group = torch.distributed.group.WORLD
    student, teacher, labels = _inputs(2)
    failures = []
    # padded vocabularies: the last slice ends in padding columns (pad 3), or is padding only (pad V: a
    # small vocabulary padded to Megatron's 128 x tp)
    for (beta, temperature), chunk, pad in itertools.product(CASES, [1024, 5], [-V % world + world, V]):
        width = (V + pad) // world

        def fill(x):
            return torch.cat([x, torch.randn(B, S, pad)], -1)[..., rank * width:(rank + 1) * width]
        want_loss, want_grad = _trl(student, teacher, labels, beta, temperature)
        s = fill(student).clone().requires_grad_()
        per_token = token_divergence(s, fill(teacher), labels, beta=beta, temperature=temperature, group=group,
                                     vocab_size=V, chunk=chunk)
        loss = per_token.sum() / (labels != -100).sum()
        loss.backward()
        mine = want_grad[..., min(rank * width, V):min((rank + 1) * width, V)]
        try:
            torch.testing.assert_close(loss, want_loss, rtol=2e-6, atol=1e-7)
            torch.testing.assert_close(s.grad[..., :mine.shape[-1]], mine, rtol=1e-5, atol=1e-8)
            assert (s.grad[..., mine.shape[-1]:] == 0).all()  # padding columns: no gradient
        except AssertionError as e:
            failures.append(f"beta={beta} T={temperature} chunk={chunk} pad={pad}: {e}")
    assert not failures, "\n".join(failures)


def test_tp2_vocab_parallel_equals_trl():
    spawn(2, _tp_rank)
