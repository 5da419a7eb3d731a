"""Named regressions of peers' GRPO bugs (issue 39), each against megaft.rl's definitions:

- verl#179: the KL term's sign (the term must be minimised, pulling the policy to the reference);
- TRL#4967: the k3 estimator's gradient (k3 in the loss alone is biased; times the ratio,
  TRL's use_bias_correction_kl, it is the reverse KL's gradient);
- NeMo-RL#4161: an fp32 residue of a group's mean inflated by the std's 1e-4 into an advantage.
"""
from __future__ import annotations

import pytest
import torch

from megaft.rl.advantages import group_advantages
from megaft.rl.losses import GlobalCounts, grpo_loss, grpo_terms

V = 11  # vocabulary of the toy policies


def _kl(policy: torch.Tensor, ref: torch.Tensor) -> float:
    """The exact KL(policy || reference) of the per-position distributions, averaged over positions."""
    p, q = torch.log_softmax(policy, -1), torch.log_softmax(ref, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _step_kl(beta: float) -> float:
    """KL to the reference after one SGD step of the GRPO loss with the KL term at `beta`."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, V, generator=g, dtype=torch.float64).requires_grad_()
    ref = torch.randn(4, 6, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (4, 6), generator=g)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    mask = torch.ones(4, 6)
    pick = lambda x: torch.log_softmax(x, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # noqa: E731
    counts = GlobalCounts(completions=4, tokens=24.0, max_completion_length=6)
    loss, _ = grpo_loss(pick(logits), None, pick(ref), advantages, mask, counts, loss_type="dapo", beta=beta)
    loss.backward()
    with torch.no_grad():
        return _kl(logits - 0.5 * logits.grad, ref)


def test_verl_179_the_kl_term_pulls_the_policy_to_the_reference():
    """verl#179: the KL penalty entered with the wrong sign, so it pushed the policy away. A step with
    beta > 0 must end nearer the reference than the same step at beta = 0; the sign flipped (beta < 0,
    what that bug computed) ends farther: the comparison can fail."""
    none, kl, flipped = _step_kl(0.0), _step_kl(0.5), _step_kl(-0.5)
    assert kl < none < flipped
    assert none - kl > 1e-3  # the pull is no rounding


@pytest.mark.parametrize("corrected", [True, False])
def test_trl_4967_the_k3_gradient(corrected):
    """TRL#4967: k3 = exp(q - p) - (q - p) - 1 in the loss has the biased gradient E_p[grad k3] =
    -sum_x q(x) grad log p(x), not grad KL(p || q); times the ratio exp(p - p.detach()) (TRL's
    use_bias_correction_kl, on by default) it is exactly grad KL. Each token x of a one-position policy
    is a completion of one token; the expectation over p is the p-weighted sum of their gradients."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_()
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    sums, _ = grpo_terms(logp.unsqueeze(1), None, ref.unsqueeze(1), torch.zeros(V, dtype=torch.float64),
                         torch.ones(V, 1), beta=1.0, bias_corrected_kl=corrected)
    # E_{x ~ p}[grad kl(x)]
    (expected,) = torch.autograd.grad((logp.exp().detach() * sums).sum(), theta, retain_graph=True)
    p = logp.exp()
    (true,) = torch.autograd.grad((p * (logp - ref)).sum(), theta)  # grad KL(p || q), analytic
    q = ref.exp()
    biased = (p - q).detach()  # -sum_x q(x) grad log p(x) in the logits: the uncorrected k3's
    if corrected:
        torch.testing.assert_close(expected, true, rtol=1e-10, atol=1e-12)
        assert (true - biased).abs().max() > 1e-2  # the two forms differ here: the test can tell them apart
    else:
        torch.testing.assert_close(expected, biased, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1 / 3])
def test_nemo_rl_4161_equal_rewards_give_advantage_zero(scale, value):
    """NeMo-RL#4161: a group whose rewards are all equal has std 0, and an fp32 mean of G copies of
    0.3 is not exactly 0.3: (r - mean) / (0 + 1e-4) turned the residue into advantages of ~3e-4. Here
    such a group's advantages are exactly 0 (two weighted functions, G = 8, beside a varied group)."""
    G = 8
    rewards = torch.full((2 * G, 2), value)
    rewards[G:, 0] = torch.arange(G) * 0.1
    advantages, metrics = group_advantages(rewards, torch.tensor([0.3, 0.7]), G, scale)
    assert torch.equal(advantages[:G], torch.zeros(G))
    assert advantages[G:].abs().min() > 1e-3  # the varied group still has its advantages
    if scale != "batch":  # the group's std is exactly 0 too: the metric counts its completions
        assert metrics["frac_reward_zero_std"] == 0.5
    summed = rewards[:G, 0] * 0.3 + rewards[:G, 1] * 0.7  # equal to the bit
    assert summed.unique().numel() == 1
    assert summed.mean() != summed[0]  # the residue guarded against: a plain fp32 mean of these is off by an ulp
