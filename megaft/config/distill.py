"""`distill.*`: logit distillation from a frozen teacher (train.objective=distill, docs/distillation.md),
TRL 1.16's generalized JSD (GKDTrainer.generalized_jsd_loss, the DistillationTrainer's divergence)
on the target tokens of the SFT data (megaft.distill)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LOSSES = ("forward_kl", "reverse_kl", "jsd")
LOSS_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}  # TRL's beta at the two ends


@dataclass
class DistillConfig:
    # the teacher: a Hugging Face checkpoint directory (config.json, weights, tokenizer.json) of a family
    # megaft reads, with the student's vocabulary and tokenizer; built at the run's layout, frozen, eval mode
    teacher: Optional[str] = None
    # forward_kl = KL(teacher || student) (TRL beta 0) | reverse_kl = KL(student || teacher) (beta 1) |
    # jsd = TRL's generalized JSD at distill.beta (0 < beta < 1; 0.5 the symmetric JSD)
    loss: str = "jsd"
    beta: float = 0.5  # read by loss=jsd only (TRL's GKDConfig/DistillationConfig.beta)
    # both models' logits divided by it before the softmax (TRL's temperature; no T^2 factor, as TRL)
    temperature: float = 1.0
    # the token cross-entropy's weight: loss = (1 - alpha) * divergence + alpha * cross-entropy, each
    # averaged over the global batch's target tokens (torchtune's KD mix with kd_ratio = 1 - alpha; TRL has
    # none: alpha = 0, the default, is TRL's loss)
    alpha: float = 0.0
    chunk_tokens: int = 1024  # target tokens whose fp32 log-probs (both models') are held at once
    # null: the teacher online at the run's layout | k: the teacher scored once before step 1 into its k most
    # likely ids and their log-probs (at distill.temperature) per target token, plus the tail's mass; training
    # then holds no teacher (megaft.distill.topk: the divergence over the k ids and the tail as one bucket)
    top_k: Optional[int] = None
    # with top_k: a folder keeping the scored top-k under the fingerprint of the teacher, data, tokenizer, k,
    # temperature and seq_len (as pref.scores); a run of the same fingerprint reads it. null: scored every run
    scores: Optional[str] = None
    # on-policy distillation (TRL's GKDTrainer, GKDConfig's names; megaft.distill.policy): the probability that
    # a step's completions are the student's own, sampled from each example's prompt (the tokens before its last
    # completion or assistant turn) at the run's layout. 0 (TRL's default is 0.5): the data's completions only
    lmbda: float = 0.0
    # the steps lmbda leaves to the data train on the teacher's sampled completions instead (sequence-level KD)
    seq_kd: bool = False
    max_new_tokens: int = 128  # the most tokens a generated completion has (GKDConfig's default)
    # the completions' sampling temperature (0: greedy). null: distill.temperature, TRL's DistillationTrainer
    # (one temperature for the samples and the divergence); GKDTrainer's loss is at temperature 1 and samples at
    # its own, so GKDConfig(temperature=T) is distill.temperature=1 distill.sampling_temperature=T
    sampling_temperature: Optional[float] = None

    @property
    def generates(self) -> bool:
        """Some steps train on generated completions (the student's or the teacher's)."""
        return self.lmbda > 0 or self.seq_kd

    @property
    def sampling(self) -> float:
        """The completions' sampling temperature."""
        return self.temperature if self.sampling_temperature is None else self.sampling_temperature

    @property
    def effective_beta(self) -> float:
        """TRL's beta of distill.loss."""
        return LOSS_BETA.get(self.loss, self.beta)


def check_distill(cfg: DistillConfig, objective: str) -> list[str]:
    """Problems of distill.* on their own, each with its fix."""
    if objective != "distill":
        return [f"distill.teacher={cfg.teacher} is read by train.objective=distill only; fix: "
                "train.objective=distill or drop distill.teacher"] if cfg.teacher else []
    problems = []
    if cfg.loss not in LOSSES:
        problems.append(f"distill.loss={cfg.loss!r} is unknown; fix: one of {', '.join(LOSSES)}")
    elif cfg.loss == "jsd" and not 0 < cfg.beta < 1:
        ends = "loss=forward_kl" if cfg.beta == 0 else "loss=reverse_kl" if cfg.beta == 1 else "beta=0.5"
        problems.append(f"distill.beta={cfg.beta} with distill.loss=jsd must be in (0, 1) (TRL's interpolation); "
                        f"fix: distill.{ends}")
    if not cfg.temperature > 0:
        problems.append(f"distill.temperature={cfg.temperature} must be > 0; fix: 1.0 (TRL's default)")
    if not 0 <= cfg.alpha <= 1:
        problems.append(f"distill.alpha={cfg.alpha} must be in [0, 1] (the cross-entropy's share); fix: 0 "
                        "(TRL's pure divergence)")
    if cfg.top_k is not None and cfg.top_k < 1:
        problems.append(f"distill.top_k={cfg.top_k} must be >= 1 (the teacher's ids kept per target token); fix: "
                        "distill.top_k=64, or null for the whole vocabulary online")
    if cfg.scores and cfg.top_k is None:
        problems.append(f"distill.scores={cfg.scores} keeps a stored top-k teacher, read with distill.top_k only; "
                        "fix: set distill.top_k or drop distill.scores")
    problems += _check_generation(cfg)
    if cfg.chunk_tokens < 1:
        problems.append(f"distill.chunk_tokens={cfg.chunk_tokens} must be >= 1")
    if not cfg.teacher:
        problems.append("train.objective=distill needs distill.teacher; fix: distill.teacher=DIR, a Hugging Face "
                        "checkpoint with the student's tokenizer")
    return problems


def _check_generation(cfg: DistillConfig) -> list[str]:
    """distill.lmbda, seq_kd, max_new_tokens and sampling_temperature on their own."""
    problems = []
    if not 0 <= cfg.lmbda <= 1:
        problems.append(f"distill.lmbda={cfg.lmbda} must be in [0, 1] (the share of steps on the student's own "
                        "completions); fix: 0.5 (TRL's GKDConfig default) or 0 (the data's completions only)")
    if cfg.max_new_tokens < 1:
        problems.append(f"distill.max_new_tokens={cfg.max_new_tokens} must be >= 1; fix: 128 (GKDConfig's default)")
    if cfg.sampling_temperature is not None and cfg.sampling_temperature < 0:
        problems.append(f"distill.sampling_temperature={cfg.sampling_temperature} must be >= 0 (0: greedy); fix: "
                        "0.9 (GKDConfig's temperature) or null (distill.temperature)")
    if cfg.generates and cfg.top_k is not None:
        problems.append(f"distill.top_k={cfg.top_k} stores the teacher's scores of the data's tokens, and distill."
                        f"{'lmbda' if cfg.lmbda > 0 else 'seq_kd'} trains on generated completions it never scored; "
                        "fix: distill.top_k=null (the teacher online scores what is generated) or distill.lmbda=0 "
                        "distill.seq_kd=false")
    return problems


def check_generation_run(cfg: DistillConfig, *, packing: str) -> list[str]:
    """On-policy distillation against the data's layout (megaft.validation)."""
    if not cfg.generates or packing == "none":
        return []
    return [f"distill.lmbda/seq_kd generate one completion a prompt, a row each (TRL's GKD batches), and "
            f"data.packing={packing} packs several documents a row; fix: data.packing=none"]
