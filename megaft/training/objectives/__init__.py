"""What a step minimizes, one module per objective, chosen by `train.objective` through a
registry (the trainer and TrainSpec never branch on it).

An `Objective` brings its data part (what a step's micro-batches are: sequences, or pairs
of rows) and its step part (how a micro-batch becomes a loss and gradients, plain or
pipelined). `sft` is next-token cross-entropy (megaft.training.objectives.sft); dpo, robust,
ipo, simpo and orpo are the preference family (megaft.training.objectives.preference, TRL's
definitions in megaft.pref.losses); grpo is online RL from verifiable rewards, on logged
rollouts (megaft.training.objectives.grpo, TRL's definitions in megaft.rl); reward trains a
reward model on the same pairs (megaft.training.objectives.reward, TRL's RewardTrainer); distill is
logit distillation from a frozen teacher on SFT data (megaft.training.objectives.distill, TRL's
generalized JSD in megaft.distill). The registry's
names are megaft.config.pref's OBJECTIVE_CHOICES, which validation checks before any rank starts.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaft.config.pref import OBJECTIVES as PREFERENCE_OBJECTIVES
from megaft.training.objectives import distill, grpo, preference, reward, sft
from megaft.training.protocols import Builder, DataPart, StepPart


@dataclass(frozen=True)
class Objective:
    """One train.objective: the builders of its data part and its step part."""

    name: str
    build_data: Builder[DataPart]
    build_step: Builder[StepPart]


REGISTRY: dict[str, Objective] = {
    "sft": Objective("sft", sft.build_data, sft.build_step),
    **{name: Objective(name, preference.build_data, preference.build_step) for name in PREFERENCE_OBJECTIVES},
    "grpo": Objective("grpo", grpo.build_data, grpo.build_step),
    "reward": Objective("reward", reward.build_data, reward.build_step),
    "distill": Objective("distill", distill.build_data, distill.build_step),
}


def objective_of(name: str) -> Objective:
    """The registered objective `name` (validation has refused any other before a rank starts)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"train.objective={name!r} is unknown; fix: one of {', '.join(REGISTRY)}") from None
