"""megaft.rl.grpo_loss does not depend on how the global batch is split: the shares of any
split into micro-batches (accumulation) and ranks (dp) add up to the whole batch's loss and
gradient, for every loss_type, because each share divides by the global batch's counts. The
per-micro-batch token mean that TRL used (TRL#3938, #5619) and verl's sample-count scale
(verl#906) are planted to show that this split test catches them."""
from __future__ import annotations

import pytest
import torch

from megaft.rl.losses import LOSS_TYPES, GlobalCounts, grpo_loss

N, T, MAX_LEN = 8, 7, 7
SPLITS = [[8], [4, 4], [1, 3, 2, 2], [5, 1, 1, 1]]  # accumulation and/or dp shares of the 8 completions


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logps = (-3 + torch.randn(N, T, generator=g)).requires_grad_()
    old = logps.detach() + 0.4 * torch.randn(N, T, generator=g)
    ref = logps.detach() + 0.4 * torch.randn(N, T, generator=g)
    lengths = torch.tensor([7, 1, 3, 5, 2, 7, 4, 6])  # very unequal: where the per-micro-batch means go wrong
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()
    return logps, old, ref, torch.randn(N, generator=g), mask


def _split_loss(loss_type, split, per_microbatch=False, beta=0.04):
    logps, old, ref, adv, mask = _batch()
    counts = GlobalCounts(completions=N, tokens=float(mask.sum()), max_completion_length=MAX_LEN)
    total, start = 0.0, 0
    for n in split:
        part = slice(start, start + n)
        local = counts
        if per_microbatch:  # the peers' bug: each micro-batch normalised by its own counts, then averaged
            local = GlobalCounts(completions=n, tokens=float(mask[part].sum()), max_completion_length=MAX_LEN)
        loss, _ = grpo_loss(logps[part], old[part], ref[part], adv[part], mask[part], local, loss_type=loss_type,
                            beta=beta)
        total = total + (loss / len(split) if per_microbatch else loss)
        start += n
    total.backward()
    return total.detach(), logps.grad.clone()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_split_gives_the_whole_batchs_loss_and_gradient(loss_type):
    want_loss, want_grad = _split_loss(loss_type, SPLITS[0])
    assert want_grad.abs().sum() > 0
    for split in SPLITS[1:]:
        loss, grad = _split_loss(loss_type, split)
        # fp32 sums regrouped: a few ulps of O(1) values
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_normalising_per_micro_batch_is_caught(loss_type):
    """Each micro-batch's own mean, averaged over the accumulation steps, moves the loss for
    unequal completion lengths (dr_grpo's constant length is immune, and so is grpo's
    completion mean over equal-sized shares: the unequal [5, 1, 1, 1] split catches it)."""
    want, _ = _split_loss(loss_type, SPLITS[0])
    wrong, _ = _split_loss(loss_type, SPLITS[3], per_microbatch=True)
    assert abs(float(wrong) - float(want)) > 1e-3 * abs(float(want))
