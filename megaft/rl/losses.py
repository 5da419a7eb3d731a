"""GRPO's policy loss, exactly as TRL 1.16's GRPOTrainer `_compute_loss` defines it
(trl/trainer/grpo_trainer.py; importance_sampling_level="token"), with its normalisation
taken over the whole global batch.

Per completion token t of completion i (mask m, advantage A_i, log-probs of the policy p,
of the policy that generated the rollouts o, and of the reference q):

    r    = exp(p - o)                                   the importance ratio
    loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)   (r first capped at `delta` when set)
    kl   = exp(q - p) - (q - p) - 1                     the k3 estimator; bias-corrected: kl * r
    l    = loss + beta kl

and the step's loss by `loss_type`, over the global batch's N completions and T completion
tokens (what TRL's formulas reduce to with one process and no accumulation):

    grpo     (1/N) sum_i (sum_t l m / max(sum_t m, 1))    each completion's token mean
    bnpo     sum l m / max(T, 1)                          TRL: over each micro-batch's tokens
    dr_grpo  sum l m / (N * max_completion_length)
    dapo     sum l m / max(T, 1)                          TRL: over the generation batch's tokens

As a per-completion loss c_i whose mean over the N completions is the step's loss
(`completion_losses`: grpo S_i / n_i, dr_grpo S_i / L, bnpo and dapo S_i N / T, with S_i and n_i
completion i's masked sum and token count), every micro-batch and rank adds its completions'
c_i and the step divides by N, as for preference pairs: the same loss and gradient at any dp,
cp (S_i and n_i summed over the cp ranks first), pp, tp and accumulation. TRL's token means
are per device or per micro-batch (TRL#3938, #5619; verl#906, #5625, #5798 for the same class
of bug): they equal these only with one process and no accumulation, which is how tests/rl
compares them.

Metrics carry TRL's names (kl, entropy, clip_ratio/low_mean, high_mean, region_mean, low_min,
high_max); `GrpoStats` holds the sums that make them global means once added over ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megaft.config.rl import LOSS_TYPES

COLUMNS = ("tokens", "kl", "entropy", "low", "high", "region")  # per completion, summed over its tokens
# a GRPO step's metrics line (TRL's names; rewards/<function>/mean and /std beside them)
METRICS = ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean",
           "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
           "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
           "completions/mean_terminated_length", "completions/min_terminated_length",
           "completions/max_terminated_length")


@dataclass(frozen=True)
class GlobalCounts:
    """The whole global batch's counts the loss divides by (every rank the same numbers)."""

    completions: int  # N: completions in the optimizer step
    tokens: float  # T: their completion tokens under the loss mask
    max_completion_length: int  # L, dr_grpo's constant length


def grpo_terms(logps: torch.Tensor, old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
               advantages: torch.Tensor, mask: torch.Tensor, *, beta: float = 0.0, epsilon: float = 0.2,
               epsilon_high: Optional[float] = None, delta: Optional[float] = None, bias_corrected_kl: bool = True,
               entropies: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(S [completions]: each completion's masked sum of per-token losses, with its graph;
    table [completions, len(COLUMNS)]: its metric sums, detached).

    logps, old_logps, ref_logps, mask, entropies: [completions, tokens] (old None: the rollouts
    came from these weights, old = logps detached; ref None when beta = 0); advantages:
    [completions]. Padding positions must be finite (their mask is 0)."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    coef_1 = torch.exp(logps - old)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("rl.beta > 0 needs the reference's log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_corrected_kl:
            kl = kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + eps_high)
    capped = torch.clamp(coef_1, max=delta) if delta is not None else coef_1
    per_token = -torch.min(capped * adv, coef_2 * adv)
    if beta != 0.0:
        per_token = per_token + beta * kl
    with torch.no_grad():
        low = ((coef_1 < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high = ((coef_1 > 1 + eps_high) & (adv > 0)).to(mask.dtype)
        zero = torch.zeros_like(mask)
        columns = (torch.ones_like(mask), kl.detach() if beta != 0.0 else zero,
                   entropies if entropies is not None else zero, low, high, torch.clamp(low + high, max=1.0))
        table = torch.stack([(c * mask).sum(-1) for c in columns], dim=1)
    return (per_token * mask).sum(-1), table


def completion_losses(sums: torch.Tensor, tokens: torch.Tensor, counts: GlobalCounts, loss_type: str) -> torch.Tensor:
    """Each completion's loss c_i, whose sum over the global batch divided by its N completions
    is the step's loss under `loss_type` (`sums`, `tokens`: S_i and n_i over the whole completion)."""
    if loss_type == "grpo":
        return sums / tokens.clamp(min=1.0)
    if loss_type == "dr_grpo":
        return sums / counts.max_completion_length
    if loss_type in ("bnpo", "dapo"):
        return sums * (counts.completions / max(counts.tokens, 1.0))
    raise ValueError(f"rl.loss_type={loss_type!r} is unknown; fix: one of {', '.join(LOSS_TYPES)}")


@dataclass
class GrpoStats:
    """The metric sums of completions (COLUMNS) and the per-completion clip extremes, added over
    micro-batches (`add`) and ranks (`reduce_over`); `metrics()` gives TRL's numbers. Detached
    tensors: nothing syncs with the host until the step logs."""

    sums: torch.Tensor  # [len(COLUMNS)]
    low_min: torch.Tensor  # the smallest per-completion share of clipped-low tokens (inf: none yet)
    high_max: torch.Tensor  # the largest of clipped-high (-inf: none yet)

    @classmethod
    def of(cls, table: torch.Tensor) -> "GrpoStats":
        """From a table of completions (over their whole length); completions without tokens
        count in no extreme, as TRL's nanmin/nanmax skip them."""
        tokens = table[:, 0]
        some = tokens > 0
        inf = torch.full_like(tokens, float("inf"))
        low = torch.where(some, table[:, 3] / tokens.clamp(min=1.0), inf).min() if len(table) else inf.sum()
        high = torch.where(some, table[:, 4] / tokens.clamp(min=1.0), -inf).max() if len(table) else -inf.sum()
        return cls(table.sum(0), low, high)

    def add(self, other: "GrpoStats") -> "GrpoStats":
        return GrpoStats(self.sums + other.sums, torch.minimum(self.low_min, other.low_min),
                         torch.maximum(self.high_max, other.high_max))

    def metrics(self, beta: float) -> dict[str, float]:
        dtype = self.sums.dtype  # the extremes are ratios of the same table: its dtype
        values = torch.cat([self.sums, self.low_min.to(dtype).view(1), self.high_max.to(dtype).view(1)]).tolist()
        sums = dict(zip(COLUMNS, values[:-2]))  # one host copy for every metric
        n = max(sums["tokens"], 1.0)
        out = {"kl": sums["kl"] / n} if beta != 0.0 else {}
        out.update({"entropy": sums["entropy"] / n, "clip_ratio/low_mean": sums["low"] / n,
                    "clip_ratio/high_mean": sums["high"] / n, "clip_ratio/region_mean": sums["region"] / n})
        low, high = values[-2:]
        out["clip_ratio/low_min"] = low if low != float("inf") else float("nan")
        out["clip_ratio/high_max"] = high if high != float("-inf") else float("nan")
        return out


def grpo_loss(logps: torch.Tensor, old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
              advantages: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts, *, loss_type: str = "dapo",
              **settings) -> tuple[torch.Tensor, GrpoStats]:
    """These completions' share of the step's loss (sum of c_i over N) and their metric sums:
    grpo_terms and completion_losses in one process, whole completions (no cp split)."""
    sums, table = grpo_terms(logps, old_logps, ref_logps, advantages, mask, **settings)
    return completion_losses(sums, table[:, 0], counts, loss_type).sum() / counts.completions, GrpoStats.of(table)
