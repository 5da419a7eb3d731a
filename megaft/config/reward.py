"""`reward.*` and train.objective=reward: a reward model (TRL 1.16's RewardTrainer and RewardConfig).

The model's LM head is replaced by a scalar head `score` (transformers' *ForSequenceClassification,
num_labels=1) read at the last real token of each row; a pair's loss is Bradley-Terry's
-logsigmoid(r_chosen - r_rejected - margin) (a record's optional "margin", else 0), plus
`center_rewards_coefficient * mean((r_chosen + r_rejected)^2)` (Eisenstein et al. 2023), averaged
over the global batch's pairs. The pairs are the preference objectives' (megaft.pref.data: the same
forms and prepared store), each row the whole prompt + answer as TRL's RewardTrainer tokenizes it,
and a pair longer than data.seq_len is dropped (TRL's max_length filter), never cut.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

OBJECTIVE = "reward"


@dataclass
class RewardConfig:
    # the weight of mean((r_chosen + r_rejected)^2), which keeps the rewards centred on 0 (TRL's
    # RewardConfig.center_rewards_coefficient; the paper's 0.01); null = off
    center_rewards_coefficient: Optional[float] = None


def is_reward(objective: str) -> bool:
    """Whether `objective` trains a reward model (a scalar head instead of the LM head)."""
    return objective == OBJECTIVE


def check_reward(cfg: RewardConfig, objective: str) -> list[str]:
    """Problems of reward.* on their own, each with its fix."""
    if cfg.center_rewards_coefficient is None:
        return []
    if not is_reward(objective):
        return [f"reward.center_rewards_coefficient={cfg.center_rewards_coefficient} is read by train.objective="
                "reward only; fix: train.objective=reward or reward.center_rewards_coefficient=null"]
    if cfg.center_rewards_coefficient < 0:
        return [f"reward.center_rewards_coefficient={cfg.center_rewards_coefficient} must be >= 0 (it weighs a "
                "square); fix: 0.01 as in the paper, or null"]
    return []


def check_reward_run(objective: str, *, has_file: bool, packing: str, n_experts: int, lora_rank: int,
                     fused_linear_cross_entropy: bool, sample_every: int = 0, then_eval: bool = False,
                     eval_pairs: Optional[str] = None) -> list[str]:
    """What train.objective=reward cannot do yet with these settings, each with its fix."""
    if not is_reward(objective):
        return []
    problems = []
    if not has_file:
        problems.append("train.objective=reward trains on preference pairs and the run has none; fix: data.path="
                        'PAIRS.jsonl (one {"prompt", "chosen", "rejected"[, "margin"]} record a line, '
                        "docs/reward-models.md) or data.sources")
    if packing == "docs":
        problems.append("train.objective=reward reads one score at the last token of each row, and data.packing="
                        "docs packs several answers a row; fix: data.packing=none (each answer a row, as TRL)")
    if n_experts > 0:
        problems.append(f"train.objective=reward with a mixture of experts (model.n_experts={n_experts}): the "
                        "router's aux loss is not wired into the reward step yet; fix: a dense model")
    if lora_rank > 0:
        problems.append("train.objective=reward with LoRA (lora.rank>0): the new score head would stay frozen "
                        "with the base (PEFT's modules_to_save is not built); fix: lora.rank=0")
    if fused_linear_cross_entropy:
        problems.append("kernels.fused_linear_cross_entropy fuses the LM head, which a reward model does not "
                        "have; fix: kernels.fused_linear_cross_entropy=false")
    if then_eval and eval_pairs is None:
        problems.append("train.then_eval=true runs lm_eval's tasks, which need a causal LM, on a reward model; fix: "
                        "eval.pairs=HELD_OUT.jsonl (its pairwise accuracy) and eval.tasks=[]")
    if sample_every > 0:
        problems.append(f"train.sample_every={sample_every} generates text, and a reward model has no LM head; fix: "
                        "train.sample_every=0 (held-out pairs' accuracy: data.eval_path)")
    return problems
