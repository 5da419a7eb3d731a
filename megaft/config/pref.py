"""`pref.*` and `train.objective`: preference tuning's settings and their validation.

`train.objective` picks what a step minimizes: `sft` (next-token cross-entropy, the
default) or a preference objective of megaft.pref.losses (dpo, robust, ipo, simpo, orpo).
Under a preference objective `data.path` holds pairs (megaft.pref.data's three forms), a
micro-batch and the global batch count pairs (each pair is two rows, chosen and rejected,
in the same micro-batch), and the loss is the mean over the global batch's pairs.

The reference model of dpo, robust and ipo is `pref.reference` (a Hugging Face checkpoint
of the same architecture), by default the model the run starts from (model.init_from, or the
seeded init; with LoRA the base, since the adapters start at zero): its completion log-probs
are computed once, before the first step, at the run's own layout, and held per pair
(megaft.training.objectives.preference.step); `pref.reference_mode=online` keeps the reference model instead and
scores each step's pairs. simpo and orpo have none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

OBJECTIVES = ("dpo", "robust", "ipo", "simpo", "orpo")  # the preference objectives (megaft.pref.losses)
REFERENCE_FREE = ("simpo", "orpo")
SMOOTHED = ("dpo", "robust", "simpo")  # the objectives that read label_smoothing
OBJECTIVE_CHOICES = ("sft",) + OBJECTIVES + ("grpo", "reward", "distill")  # grpo: megaft.config.rl; reward:
# megaft.config.reward; distill: megaft.config.distill
REFERENCE_MODES = ("precompute", "online")


@dataclass
class PrefConfig:
    # dpo/robust/ipo: the KL weight (IPO's tau); simpo: the reward scale; orpo: the odds-ratio
    # weight (the paper's lambda, TRL's ORPOConfig.beta)
    beta: float = 0.1
    # dpo (cDPO), robust, simpo: the probability that a pair's labels are flipped
    label_smoothing: float = 0.0
    gamma: float = 0.5  # simpo: the target reward margin (TRL's CPOConfig.simpo_gamma)
    # dpo/robust/ipo: a Hugging Face checkpoint of the same architecture to compare with; null = the
    # model the run starts from (model.init_from, or with LoRA the base)
    reference: Optional[str] = None
    # with data.packing=docs: a pair's prompt once in its row, both answers attending to it (a tree mask);
    # the same losses and gradients as unshared packing, the prompt computed once instead of twice
    share_prompt: bool = False
    # dpo/robust/ipo: precompute (score every pair once before step 1, hold 4 floats a pair) | online (keep
    # the reference model beside the policy and score each step's pairs, as TRL's DPOTrainer does by default)
    reference_mode: str = "precompute"
    # precompute: a folder keeping the reference log-probs under their fingerprint (the reference's weights,
    # the pairs, the tokenizer, seq_len, precision), read by later runs instead of scoring again; store = in
    # the pairs' prepared store (data.cache_dir); null = none
    scores: Optional[str] = None


def is_preference(objective: str) -> bool:
    """Whether `objective` trains on pairs (the preference family)."""
    return objective in OBJECTIVES


def reads_pairs(objective: str) -> bool:
    """Whether `objective` reads preference pairs (megaft.pref.data): the preference family and
    reward models (megaft.config.reward)."""
    return is_preference(objective) or objective == "reward"


def needs_reference(objective: str) -> bool:
    """Whether `objective` reads a reference model's log-probs (dpo, robust, ipo)."""
    return is_preference(objective) and objective not in REFERENCE_FREE


def check_pref(cfg: PrefConfig, objective: str) -> list[str]:
    """Problems of train.objective and pref.* on their own, each with its fix."""
    if objective not in OBJECTIVE_CHOICES:
        return [f"train.objective={objective!r} is unknown; fix: one of {', '.join(OBJECTIVE_CHOICES)}"]
    modes = [] if cfg.reference_mode in REFERENCE_MODES else [
        f"pref.reference_mode={cfg.reference_mode!r} is unknown; fix: {' or '.join(REFERENCE_MODES)}"]
    if not is_preference(objective):
        return modes
    if cfg.reference_mode == "online" and not needs_reference(objective):
        modes.append(f"pref.reference_mode=online: train.objective={objective} has no reference model; fix: "
                     "pref.reference_mode=precompute")
    if cfg.scores is not None and (not needs_reference(objective) or cfg.reference_mode == "online"):
        why = (f"train.objective={objective} has no reference model" if not needs_reference(objective) else
               "pref.reference_mode=online scores every step")
        modes.append(f"pref.scores={cfg.scores} keeps precomputed reference log-probs, and {why}; fix: "
                     "pref.scores=null")
    return modes + [f"pref.{p}" if p.startswith(("beta", "label_smoothing")) else p
                    for p in check_preference(objective, beta=cfg.beta, label_smoothing=cfg.label_smoothing)]


def check_pref_run(objective: str, *, has_file: bool, packing: str, n_experts: int,
                   share_prompt: bool = False, cp: int = 1, window: bool = False,
                   capacity: bool = False, global_aux: bool = False) -> list[str]:
    """What a preference run cannot do yet in this layout or with this data, each with its fix."""
    if not is_preference(objective):
        return [f"pref.share_prompt=true shares preference pairs' prompts, and train.objective={objective} has no "
                "pairs; fix: pref.share_prompt=false"] if share_prompt else []
    problems = []
    what = f"train.objective={objective}"
    if not has_file:
        problems.append(f"{what} trains on preference pairs and the run has none; fix: data.path=PAIRS.jsonl "
                        '(one {"prompt", "chosen", "rejected"} record a line, docs/preference.md) or data.sources')
    if share_prompt and packing != "docs":  # stream (the default) and none: each answer a row of its own
        problems.append(f"pref.share_prompt=true puts a pair's prompt once in a packed row, and data.packing="
                        f"{packing} gives each answer a row of its own; fix: data.packing=docs")
    if share_prompt and cp > 1:
        problems.append(f"pref.share_prompt=true with parallel.cp={cp}: the context-parallel ring keeps documents "
                        "apart and has no shared prompt yet; fix: pref.share_prompt=false (packing still works)")
    if share_prompt and window:
        problems.append("pref.share_prompt=true with a sliding-window model: the window counts row positions, "
                        "which a shared prompt moves apart; fix: pref.share_prompt=false")
    moe = f"{what} with a mixture of experts (model.n_experts={n_experts})"
    if n_experts and (capacity or global_aux):
        problems.append(f"{moe} balances each micro-batch's tokens without a capacity, as TRL's DPOTrainer adds "
                        "transformers' aux loss; fix: moe.capacity_factor=null and moe.aux_scope=micro_batch")
    return problems


def check_preference(objective: str, *, beta: float, label_smoothing: float) -> list[str]:
    """Every problem of these settings, with its fix (empty: valid)."""
    if objective not in OBJECTIVES:
        return [f"objective {objective!r} is unknown; fix: one of {', '.join(OBJECTIVES)}"]
    problems = []
    if not beta > 0:
        problems.append(f"beta={beta} must be > 0 (the objectives divide by it or scale rewards by it)")
    if label_smoothing and objective not in SMOOTHED:
        problems.append(f"label_smoothing={label_smoothing} has no meaning for {objective} (TRL ignores it); "
                        f"fix: 0, or objective one of {', '.join(SMOOTHED)}")
    elif objective == "robust" and not 0 <= label_smoothing < 0.5:
        problems.append(f"label_smoothing={label_smoothing}: robust DPO needs a flip probability in [0, 0.5)")
    elif not 0 <= label_smoothing <= 1:
        problems.append(f"label_smoothing={label_smoothing} must lie in [0, 1]")
    return problems
