"""Group-relative advantages, exactly as TRL 1.16's GRPOTrainer computes them
(trl/trainer/grpo_trainer.py `_generate_and_score_completions`, multi_objective_aggregation
"sum_then_normalize", its default).

The rewards of the whole generation batch come in, every rank the same ([completions,
functions], NaN where a function returned None): a group's mean and std span its G
completions wherever they train, and `scale_rewards="batch"` takes one std over every
completion (TRL#3991 computed it per group; tests/rl checks the batch std is one number). A group
of equal rewards gets advantages exactly 0 (NeMo-RL#4161: TRL's fp32 mean leaves a residue that
the 1e-4 of the std's epsilon scales up).
"""
from __future__ import annotations

import torch

from megaft.config.rl import SCALE_REWARDS

STD_EPS = 1e-4  # TRL's: advantages = (r - mean) / (std + 1e-4)


def nanstd(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs (TRL's trl.trainer.utils.nanstd): NaN with < 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=x.dtype))
    variance = variance * correction
    if not keepdim:
        variance = variance.squeeze(dim) if dim is not None else variance.reshape(())
    return torch.sqrt(variance)


def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, dict[str, float]]:
    """(advantages [completions], TRL's reward metrics) for rewards [completions, functions], completions
    ordered group by group (G consecutive completions of one prompt).

    A completion every function declined (all NaN) is unscorable: left out of its group's mean
    and std, and its advantage is 0, as TRL does."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"rl.scale_rewards={scale_rewards!r}; fix: one of {', '.join(SCALE_REWARDS)}")
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % num_generations:
        raise ValueError(f"rewards of shape {tuple(rewards_per_func.shape)} are not whole groups of "
                         f"{num_generations} completions")
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    # each group's mean as its smallest reward plus the mean of the offsets from it: a group of equal rewards
    # has mean exactly its reward, so advantage exactly 0 (a plain fp32 mean's rounding residue, / (0 + 1e-4),
    # gave those completions advantages of up to ~1e-3: NeMo-RL#4161); other groups' mean moves by rounding only
    base = torch.where(torch.isnan(grouped), torch.inf, grouped).amin(dim=1, keepdim=True)
    base = torch.where(torch.isinf(base), torch.zeros_like(base), base)  # a group every function declined
    mean = (base.squeeze(1) + torch.nanmean(grouped - base, dim=1)).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ("group", "none"):  # "none" keeps the group std for the zero-std count only
        # of the offsets too: exactly 0 for equal rewards, so frac_reward_zero_std counts the group
        std = (nanstd(grouped - base, dim=1).repeat_interleave(num_generations, dim=0) if num_generations > 1
               else torch.zeros_like(rewards))
    else:
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    logged = (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    logged[unscorable] = torch.nan
    values = torch.stack([torch.nanmean(logged), nanstd(logged),
                          torch.isclose(std, torch.zeros_like(std)).float().mean()]).tolist()  # one host copy
    return advantages, dict(zip(("reward", "reward_std", "frac_reward_zero_std"), values))


def function_metrics(rewards_per_func: torch.Tensor, names: list[str]) -> dict[str, float]:
    """TRL's rewards/<name>/mean and /std: over the completions each function scored."""
    if not names:
        return {}
    values = torch.stack([v for i in range(len(names)) for v in (
        torch.nanmean(rewards_per_func[:, i]), nanstd(rewards_per_func[:, i]))]).tolist()  # one host copy
    return dict(zip([f"rewards/{name}/{m}" for name in names for m in ("mean", "std")], values))


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completions/* metrics over the global batch: each completion's length in tokens
    (`lengths`) and whether it was cut at its length limit (`truncated`: its last token is no eos
    nor the pad id, whatever rl.mask_truncated_completions). The terminated lengths are TRL's
    single 0 when every completion was truncated."""
    lengths = lengths.float()
    done = lengths[~truncated]
    if len(done) == 0:  # TRL's edge case: no completion ended on an eos
        done = torch.zeros(1)
    names = ("mean_length", "min_length", "max_length", "clipped_ratio", "mean_terminated_length",
             "min_terminated_length", "max_terminated_length")
    values = torch.stack([lengths.mean(), lengths.min(), lengths.max(), truncated.float().mean(), done.mean(),
                          done.min(), done.max()]).tolist()  # one host copy, not one a metric
    return {f"completions/{n}": v for n, v in zip(names, values)}
