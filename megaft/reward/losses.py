"""A reward model's quantities, as TRL 1.16's RewardTrainer.compute_loss defines them.

The reward of a row is the scalar head at its last real token. transformers'
*ForSequenceClassification finds that token by searching for pad_token_id (the rightmost token
that is not padding), which scores the token before the end when pad == eos and the row ends
with eos (transformers#35352, TRL#937/#2778); here it comes from the attention mask (or the
row lengths), so right padding, left padding and pad == eos all read the last real token.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

METRICS = ("accuracy", "margin", "mean_reward")  # means over the pairs (TRL's names)
REWARD_METRICS = METRICS + ("min_reward", "max_reward")  # a step's metrics line


def last_token_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[rows, seq] True at each row's last position where `attention_mask` is set (right or left
    padding alike: the highest such position); a row without any is all False."""
    mask = attention_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(1, keepdim=True)
    return positions == last


def length_mask(lengths: torch.Tensor, seq: int) -> torch.Tensor:
    """`last_token_mask` of right-padded rows of `lengths` real tokens, [rows, seq]."""
    return torch.arange(seq, device=lengths.device) == (lengths.to(torch.long) - 1).unsqueeze(1)


def sequence_rewards(scores: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Each row's reward [rows] (fp32): the head's `scores` [rows, seq] at its `last` position (a
    select, not a product: whatever the padding's scores are, they never reach the reward)."""
    return torch.where(last, scores.float(), 0.0).sum(-1)


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: Optional[torch.Tensor] = None,
                center_rewards_coefficient: Optional[float] = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair losses [pairs], per-pair metrics): Bradley-Terry -logsigmoid(r_c - r_r - margin),
    plus coef * (r_c + r_r)^2, whose mean over the batch is TRL's coef * mean((r_c + r_r)^2);
    metrics `accuracy` (r_c > r_r), `margin` (r_c - r_r) and `mean_reward` ((r_c + r_r) / 2)."""
    diff = chosen - rejected
    losses = -F.logsigmoid(diff - margin if margin is not None else diff)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    with torch.no_grad():
        metrics = {"accuracy": (chosen > rejected).float(), "margin": diff.detach(),
                   "mean_reward": ((chosen + rejected) / 2).detach()}
    return losses, metrics
