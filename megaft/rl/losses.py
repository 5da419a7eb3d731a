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

Each micro-batch returns its share (its sums over these global counts), so the shares of all
micro-batches and ranks add up to the loss and their gradients to its gradient at any dp, cp,
pp, tp and accumulation. TRL's token means are per device or per micro-batch (TRL#3938,
#5619; verl#906, #5625, #5798 for the same class of bug): they equal these only with one
process and no accumulation, which is how tests/rl compares them.

Metrics carry TRL's names (kl, entropy, clip_ratio/low_mean, high_mean, region_mean, low_min,
high_max); `GrpoStats` holds the sums that make them global means once added over ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass(frozen=True)
class GlobalCounts:
    """The whole global batch's counts the loss divides by (every rank the same numbers)."""

    completions: int  # N: completions in the optimizer step
    tokens: float  # T: their completion tokens under the loss mask
    max_completion_length: int  # dr_grpo's constant length


@dataclass
class GrpoStats:
    """Sums over a micro-batch's completion tokens (detached tensors: no host sync until the
    step logs), added over micro-batches and ranks; `metrics()` gives TRL's numbers."""

    tokens: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    region: torch.Tensor
    low_per_completion: torch.Tensor  # each completion's share of clipped-low tokens (NaN: no tokens)
    high_per_completion: torch.Tensor

    SUMS = ("tokens", "kl", "entropy", "low", "high", "region")

    def add(self, other: "GrpoStats") -> "GrpoStats":
        sums = {name: getattr(self, name) + getattr(other, name) for name in self.SUMS}
        return GrpoStats(**sums, low_per_completion=torch.cat([self.low_per_completion, other.low_per_completion]),
                         high_per_completion=torch.cat([self.high_per_completion, other.high_per_completion]))

    def metrics(self, beta: float) -> dict[str, float]:
        n = max(float(self.tokens), 1.0)
        out = {"kl": float(self.kl) / n} if beta != 0.0 else {}
        out.update({"entropy": float(self.entropy) / n, "clip_ratio/low_mean": float(self.low) / n,
                    "clip_ratio/high_mean": float(self.high) / n, "clip_ratio/region_mean": float(self.region) / n})
        low = self.low_per_completion[~torch.isnan(self.low_per_completion)]  # TRL's nanmin / nanmax
        high = self.high_per_completion[~torch.isnan(self.high_per_completion)]
        out["clip_ratio/low_min"] = float(low.min()) if low.numel() else float("nan")
        out["clip_ratio/high_max"] = float(high.max()) if high.numel() else float("nan")
        return out


def check_loss(loss_type: str, beta: float, epsilon: float, epsilon_high: Optional[float]) -> list[str]:
    problems = []
    if loss_type not in LOSS_TYPES:
        problems.append(f"rl.loss_type={loss_type!r} is unknown; fix: one of {', '.join(LOSS_TYPES)}")
    if beta < 0:
        problems.append(f"rl.beta={beta} must be >= 0 (0: no KL term and no reference model)")
    if not 0 < epsilon < 1 or (epsilon_high is not None and epsilon_high <= 0):
        problems.append(f"rl.epsilon={epsilon} must be in (0, 1) and rl.epsilon_high={epsilon_high} > 0 "
                        "(the clip range is [1 - epsilon, 1 + epsilon_high])")
    return problems


def grpo_loss(logps: torch.Tensor, old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
              advantages: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts, *, loss_type: str = "dapo",
              beta: float = 0.0, epsilon: float = 0.2, epsilon_high: Optional[float] = None,
              delta: Optional[float] = None, bias_corrected_kl: bool = True,
              entropies: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, GrpoStats]:
    """This micro-batch's share of the step's loss, and its metric sums.

    logps, old_logps, ref_logps, mask, entropies: [completions, tokens] (old None: the rollouts
    came from these weights, so old = logps detached; ref None when beta = 0); advantages:
    [completions]. Padding positions must be finite (their mask is 0)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(check_loss(loss_type, beta, epsilon, epsilon_high)[0])
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)
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
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / counts.completions
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (counts.completions * counts.max_completion_length)
    else:  # bnpo, dapo
        loss = masked.sum() / max(counts.tokens, 1.0)
    with torch.no_grad():
        zero = mask.new_zeros(())
        low = ((coef_1 < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high = ((coef_1 > 1 + eps_high) & (adv > 0)).to(mask.dtype)
        region = torch.clamp(low + high, max=1.0)
        per_completion = mask.sum(-1)  # 0 tokens: NaN, which the min/max skip (TRL's nanmin/nanmax)
        stats = GrpoStats(tokens=mask.sum(), kl=(kl * mask).sum() if beta != 0.0 else zero,
                          entropy=(entropies * mask).sum() if entropies is not None else zero,
                          low=(low * mask).sum(), high=(high * mask).sum(), region=(region * mask).sum(),
                          low_per_completion=(low * mask).sum(-1) / per_completion,
                          high_per_completion=(high * mask).sum(-1) / per_completion)
    return loss, stats
