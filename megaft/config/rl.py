"""`rl.*`: online RL from verifiable rewards (train.objective=grpo), named as TRL's GRPOConfig
names them (docs/rl.md). The definitions are TRL 1.16's GRPOTrainer (megaft.rl)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # megaft.rl.losses
SCALE_REWARDS = ("group", "batch", "none")  # megaft.rl.advantages
THINK_FORMAT = r"^<think>(?!.*<think>)(.*?)</think>.*$"  # TRL's think_format_reward pattern


@dataclass
class RLConfig:
    # JSONL of logged rollouts, one prompt a line: {"prompt_ids": [...], "completion_ids": [[...] x G],
    # "rewards": [G floats]}; read instead of generating (TRL's rollout_func role)
    rollouts: Optional[str] = None
    # JSONL of prompts, {"prompt": str} or {"messages": [...]} a line (other fields go to the reward
    # functions): the policy generates rl.num_generations completions of each at the training layout
    # every step (online), scored by rl.reward. One of rl.rollouts and rl.prompts
    prompts: Optional[str] = None
    # reward functions scoring the completions (megaft.rl.rewards): built-ins exact_match, math, format, a reward
    # model model:DIR (docs/reward-models.md), or package.module:function with TRL's signature; set, the
    # rollouts carry no "rewards" of their own
    reward: List[str] = field(default_factory=list)
    reward_weights: Optional[List[float]] = None  # one per rl.reward; null = 1 each
    format_pattern: str = THINK_FORMAT  # the built-in `format` reward's pattern (re.match, DOTALL, MULTILINE)
    num_generations: int = 8  # G: completions per prompt, one group (train.global_batch_size counts completions)
    max_completion_length: int = 256  # dr_grpo's constant length; longer logged completions are refused
    # the policy's (and the reference's) log-probs are of logits / temperature; rl.prompts samples at it
    temperature: float = 1.0
    # nucleus sampling of rl.prompts' rollouts: each draw keeps the most likely tokens whose probabilities reach
    # top_p (transformers' TopPLogitsWarper, after the temperature); 1.0 (TRL's default) keeps every token
    top_p: float = 1.0
    beta: float = 0.0  # the KL coefficient; 0 (TRL's default): no KL term and no reference model
    # beta > 0: a Hugging Face checkpoint of the same architecture the KL term compares with; null = the
    # model the run starts from (model.init_from or the seeded init; with LoRA the base, as TRL)
    reference: Optional[str] = None
    epsilon: float = 0.2  # the clip range's lower side: ratios below 1 - epsilon stop pulling
    epsilon_high: Optional[float] = None  # its upper side (DAPO: 0.28); null = epsilon
    delta: Optional[float] = None  # two-sided clipping: the ratio capped at delta (null = off)
    scale_rewards: str = "group"  # group | batch | none: the std advantages are divided by
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo (TRL's default): how token losses are averaged
    use_bias_correction_kl: bool = True  # the k3 KL times the importance ratio (TRL's default)
    # mu: optimizer steps per generated (or read) batch, each on the same micro-batches; > 1: the clipped ratio's
    # old log-probs are the generating weights' (TRL's num_iterations; 1: on-policy, the ratio is 1)
    num_iterations: int = 1
    # drop from the loss completions cut at their length limit (last token no eos): TRL's, DAPO's overlong filter
    mask_truncated_completions: bool = False


def check_rl(cfg: RLConfig, objective: str, *, global_batch_size: int, micro_batch_size: int) -> list[str]:
    """Problems of rl.* on their own, each with its fix (none unless train.objective=grpo)."""
    if objective != "grpo":
        return [f"rl.{k}={getattr(cfg, k)} is read by train.objective=grpo only; fix: train.objective=grpo or drop "
                f"rl.{k}" for k in ("rollouts", "prompts") if getattr(cfg, k)]
    problems = []
    if cfg.loss_type not in LOSS_TYPES:
        problems.append(f"rl.loss_type={cfg.loss_type!r} is unknown; fix: one of {', '.join(LOSS_TYPES)}")
    if cfg.scale_rewards not in SCALE_REWARDS:
        problems.append(f"rl.scale_rewards={cfg.scale_rewards!r} is unknown; fix: one of {', '.join(SCALE_REWARDS)}")
    if cfg.num_generations < 2:
        problems.append(f"rl.num_generations={cfg.num_generations}: a group needs at least 2 completions to compare "
                        "(its advantages are relative to its mean); fix: rl.num_generations >= 2")
    elif global_batch_size % cfg.num_generations:
        problems.append(f"train.global_batch_size={global_batch_size} completions is not whole groups of "
                        f"rl.num_generations={cfg.num_generations}; fix: a multiple of {cfg.num_generations}")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.reward):
        problems.append(f"rl.reward_weights has {len(cfg.reward_weights)} weights for {len(cfg.reward)} rl.reward "
                        "functions; fix: one weight each, or null for 1 each")
    if cfg.max_completion_length < 1:
        problems.append(f"rl.max_completion_length={cfg.max_completion_length} must be >= 1")
    if cfg.beta < 0:
        problems.append(f"rl.beta={cfg.beta} must be >= 0 (0: no KL term and no reference model)")
    if not 0 < cfg.epsilon < 1 or (cfg.epsilon_high is not None and cfg.epsilon_high <= 0):
        problems.append(f"rl.epsilon={cfg.epsilon} must be in (0, 1) and rl.epsilon_high={cfg.epsilon_high} > 0 "
                        "(the clip range is [1 - epsilon, 1 + epsilon_high])")
    if cfg.delta is not None and cfg.delta <= 1 + (cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high):
        problems.append(f"rl.delta={cfg.delta} caps the ratio below the clip range's top; fix: rl.delta > 1 + "
                        "rl.epsilon_high (DeepSeek-V3.2 uses 10) or null")
    if isinstance(cfg.num_iterations, bool) or not isinstance(cfg.num_iterations, int) or cfg.num_iterations < 1:
        problems.append(f"rl.num_iterations={cfg.num_iterations!r} must be a whole number >= 1 (the optimizer steps "
                        "each generated batch is trained on); fix: 1 (on-policy, TRL's default) or e.g. 2")
    if cfg.temperature <= 0:
        problems.append(f"rl.temperature={cfg.temperature} must be > 0: the log-probs are of logits / temperature "
                        "(TRL's selective_log_softmax too) and transformers' sampling refuses 0, so TRL has no greedy "
                        "rollouts; fix: 1.0 (TRL's default), or e.g. 0.1 for near-greedy draws")
    if not 0 < cfg.top_p <= 1:
        problems.append(f"rl.top_p={cfg.top_p} must be in (0, 1] (the probability mass each draw keeps); fix: e.g. "
                        "0.95, or 1.0 to keep every token")
    return problems


def check_rl_run(cfg: RLConfig, objective: str, *, has_data_file: bool, n_experts: int, packing: str,
                 cp: int = 1) -> list[str]:
    """What train.objective=grpo cannot do yet here, each with its fix (docs/rl.md: what is built)."""
    if objective != "grpo":
        return []
    problems = []
    if bool(cfg.rollouts) == bool(cfg.prompts):
        problems.append("train.objective=grpo needs one source of rollouts: " + (
            "rl.rollouts and rl.prompts are both set; fix: drop one" if cfg.rollouts else
            'neither rl.rollouts nor rl.prompts is set; fix: rl.prompts=FILE.jsonl ({"prompt": str} or '
            '{"messages": [...]} a line: the policy generates the completions) with rl.reward=[...], or '
            'rl.rollouts=FILE.jsonl (logged: one {"prompt_ids", "completion_ids", "rewards"} object a line)') +
            " (docs/rl.md)")
    if cfg.prompts and not cfg.reward:
        problems.append(f"rl.prompts={cfg.prompts}: generated completions need reward functions to score them; fix: "
                        "rl.reward=[exact_match] (or math, format, or package.module:function; docs/rl.md)")
    if has_data_file:
        problems.append("train.objective=grpo reads its prompts from rl.prompts or rl.rollouts, and data.path/"
                        "data.sources are set; fix: drop them (data= keeps the tokenizer settings)")
    if cfg.reference and cfg.beta == 0.0:
        problems.append(f"rl.reference={cfg.reference} is read by the KL term only, and rl.beta=0; fix: rl.beta > 0 "
                        "(e.g. 0.04) or rl.reference=null")
    if cfg.rollouts and cfg.top_p != 1.0:
        problems.append(f"rl.top_p={cfg.top_p} filters the draws of generated rollouts, and rl.rollouts={cfg.rollouts} "
                        "are read, not drawn; fix: rl.top_p=1.0, or generate with rl.prompts=FILE")
    if packing == "docs":
        problems.append("train.objective=grpo gives each completion a row of its own; fix: data.packing=none")
    return problems
