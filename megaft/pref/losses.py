"""Preference objectives, exactly as TRL defines them (DESIGN.md: TRL is the specification).

Every objective reads per-sequence log-probabilities of the completions as
(sum, token count) pairs (megaft.pref.logps.SequenceLogps), so that where TRL averages
over the completion's tokens the average is exact, and where it sums nothing is lost.
The TRL code each follows (TRL 1.16; trl/trainer/dpo_trainer.py `_compute_loss`,
trl/experimental/cpo/cpo_trainer.py `cpo_loss`, trl/experimental/orpo/orpo_trainer.py
`odds_ratio_loss`):

    objective  TRL                                   per-pair loss (d: chosen minus rejected)
    dpo        DPOTrainer loss_type="sigmoid"        -logsig(b d) (1-e) - logsig(-b d) e,  d = summed log-ratios
    robust     DPOTrainer loss_type="robust"         (-logsig(b d) (1-e) + logsig(-b d) e) / (1 - 2e)
    ipo        DPOTrainer loss_type="ipo"            (d - 1/(2b))^2,  d = log-ratios averaged per token
    simpo      CPOTrainer loss_type="simpo",         -logsig(b d') (1-e) - logsig(-b d') e,
               cpo_alpha=0                           d' = policy log-probs averaged per token - gamma/b
    orpo       ORPOTrainer                           NLL(chosen) - b logsig(log odds(chosen) - log odds(rejected)),
                                                     odds of the log-probs averaged per token

(b = beta, e = label_smoothing, logsig = log sigmoid, log-ratio = policy minus reference.)
`dpo` with e > 0 is conservative DPO (cDPO): TRL's loss_type="sigmoid" up to 0.28, and
CPOTrainer's sigmoid/simpo still; TRL >= 0.29's DPOTrainer "sigmoid" ignores
label_smoothing, whose robust form is `robust` (e = the probability a label is flipped).

Metrics carry TRL's names; each is a [pairs] tensor (detached) whose mean over the batch
is the number TRL logs. "Rewards" are b times DPO's summed log-ratios (also for IPO, since
TRL 0.29), b times the averaged policy log-probs for SimPO and ORPO (reference-free);
logps/* are the summed log-probs for DPO/IPO and the averaged ones for SimPO and ORPO.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megaft.config.pref import OBJECTIVES, REFERENCE_FREE, check_preference
from megaft.pref.logps import SequenceLogps

# the metrics every objective returns (TRL's names), and ORPO's three more
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (TRL's ORPO helper)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def smoothed_sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(b x) weighted 1 - e plus -log sigmoid(-b x) weighted e: the DPO/CPO
    sigmoid loss with a label believed flipped with probability e (cDPO)."""
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


def preference_loss(objective: str, policy_chosen: SequenceLogps, policy_rejected: SequenceLogps,
                    ref_chosen: Optional[SequenceLogps] = None, ref_rejected: Optional[SequenceLogps] = None, *,
                    beta: float, label_smoothing: float = 0.0, gamma: float = 0.5,
                    chosen_nll: Optional[SequenceLogps] = None, nll_tokens: Optional[float] = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair losses [pairs], metrics) of `objective` (see the module's table); the
    training loss is `losses.mean()`, as TRL's.

    `ref_*`: the reference model's log-probs (dpo, robust, ipo; None for the
    reference-free simpo and orpo). `gamma`: SimPO's target margin (CPOConfig.simpo_gamma).
    `chosen_nll`: ORPO's SFT term, the policy's log-probs of the chosen rows over prompt
    AND answer (TRL's ORPO labels every non-pad token there): its NLL, summed over the
    rows and divided by their total count (the batch's token mean, as nn.CrossEntropyLoss
    in TRL), is added to every pair's loss with weight 1; beta weights the odds-ratio term
    (the paper's lambda). `nll_tokens`: what that sum is divided by instead of the rows' own
    count (a training step's micro-batch: its share of the global batch's mean)."""
    problems = check_preference(objective, beta=beta, label_smoothing=label_smoothing)
    reference = ref_chosen is not None and ref_rejected is not None
    if objective in REFERENCE_FREE and (ref_chosen is not None or ref_rejected is not None):
        problems.append(f"{objective} is reference-free; fix: pass no reference log-probs")
    elif objective not in REFERENCE_FREE and objective in OBJECTIVES and not reference:
        problems.append(f"{objective} needs the reference model's log-probs of the chosen and rejected answers")
    if (objective == "orpo") != (chosen_nll is not None):
        problems.append("chosen_nll is ORPO's SFT term: pass it for orpo and only for orpo")
    if problems:
        raise ValueError("; ".join(problems))
    if objective in REFERENCE_FREE:
        return _reference_free(objective, policy_chosen, policy_rejected, beta=beta,
                               label_smoothing=label_smoothing, gamma=gamma, chosen_nll=chosen_nll,
                               nll_tokens=nll_tokens)
    chosen_ratio = policy_chosen.sum - ref_chosen.sum
    rejected_ratio = policy_rejected.sum - ref_rejected.sum
    if objective == "ipo":
        # TRL normalizes IPO's log-ratios by the completion length (confirmed with the IPO authors; the
        # paper's results use it); eq. 17 of the paper, beta being its tau
        delta = chosen_ratio / policy_chosen.count.clamp(min=1) - rejected_ratio / policy_rejected.count.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    elif objective == "robust":  # Chowdhury et al. 2024: unbiased under labels flipped with probability e
        delta, e = chosen_ratio - rejected_ratio, label_smoothing
        losses = (-F.logsigmoid(beta * delta) * (1 - e) + F.logsigmoid(-beta * delta) * e) / (1 - 2 * e)
    else:
        losses = smoothed_sigmoid_loss(chosen_ratio - rejected_ratio, beta, label_smoothing)
    # TRL >= 0.29 logs the summed log-ratios and log-probs for every DPO loss type, IPO included
    metrics = _reward_metrics(beta * chosen_ratio.detach(), beta * rejected_ratio.detach(),
                              policy_chosen.sum, policy_rejected.sum)
    return losses, metrics


def _reference_free(objective: str, policy_chosen: SequenceLogps, policy_rejected: SequenceLogps, *, beta: float,
                    label_smoothing: float, gamma: float, chosen_nll: Optional[SequenceLogps],
                    nll_tokens: Optional[float] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO (Meng et al. 2024) and ORPO (Hong et al. 2024) on per-token averaged log-probs."""
    chosen, rejected = policy_chosen.mean().float(), policy_rejected.mean().float()
    extra = {}
    if objective == "simpo":
        losses = smoothed_sigmoid_loss(chosen - rejected - gamma / beta, beta, label_smoothing)
    else:
        # log odds(p) = log p - log(1 - p), on the averaged log-probs (eqs. 4 and 7 of the paper)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        nll = -chosen_nll.sum.sum() / (chosen_nll.count.sum() if nll_tokens is None else nll_tokens)
        losses = nll - beta * ratio
        pairs = losses.shape
        extra = {"nll_loss": nll.detach().expand(pairs), "log_odds_ratio": ratio.detach(),
                 "log_odds_chosen": log_odds.detach()}
    return losses, {**_reward_metrics(beta * chosen.detach(), beta * rejected.detach(), chosen, rejected), **extra}


def _reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                    rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's rewards/* and logps/* metrics, per pair."""
    return {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": chosen_logps.detach(), "logps/rejected": rejected_logps.detach()}
