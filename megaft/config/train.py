"""TrainConfig (`train.*`): steps, batch arithmetic, evaluation and output; SampleConfig
(`sample.*`): what train.sample_every generates (megaft.training.samples; its prompt file is
read and checked by megaft.data.prompts)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

from megaft.config.checks import at_least


@dataclass
class TrainConfig:
    max_steps: Optional[int] = 300  # optimizer steps; 0 = only evaluate; null: train.epochs sizes the run
    # passes over the data instead of max_steps (null max_steps): a float, 1.5 allowed; resolved once before any
    # rank starts into the steps they mean (config.yaml's derived.epochs; megaft.training.epochs)
    epochs: Optional[float] = None
    micro_batch_size: int = 32  # sequences per forward/backward on one rank
    global_batch_size: int = 64  # sequences per optimizer step over all dp ranks
    eval_every: int = 50  # evaluate every N steps (and at step 0, before any update)
    eval_batch_size: int = 64  # eval sequences per forward
    seed: int = 0  # model initialization and dropout
    # write the final model as a Hugging Face directory (run_dir/hf); null = auto: when the run
    # starts from a checkpoint (model.init_from) and zero < 3 (megaft.config.keep)
    export_hf: Optional[bool] = None
    progress: bool = True  # progress bar on stdout (rank 0)
    save_every: int = 0  # checkpoint every N steps into run_dir/checkpoints (0 = none between)
    save_final: bool = True  # checkpoint the last step too: a run keeps what it trained (megaft.config.keep)
    keep_last: int = 2  # keep the newest N checkpoints, delete older ones; 0 = keep all
    resume: bool = True  # start from the newest complete checkpoint in run_dir/checkpoints, if any
    async_save: bool = False  # write checkpoint shards in a background thread while training goes on
    peak_tflops: float = 0.0  # per-GPU peak TFLOP/s for MFU; 0 = the device table (megaft.perf.hardware), CPU: none
    log_phases: bool = True  # forward/backward/optimizer/comm seconds in every metrics line (CUDA events)
    tensorboard: str = "auto"  # auto | true | false: event files in run_dir/tensorboard (auto: when installed)
    # Abort after this many consecutive steps with a non-finite loss or grad norm (fp16 overflow skips
    # included; megaft.training.guards); no checkpoint is written during such a streak. 0 = never abort.
    max_bad_steps: int = 10
    straggler_every: int = 0  # gather every rank's step time every N steps (one small all-gather); 0 = off
    straggler_factor: float = 1.5  # warn about a rank slower than the median step time times this
    # what a step minimizes: sft (next-token cross-entropy) | dpo | robust | ipo | simpo | orpo (preference
    # pairs, settings in pref.*: docs/preference.md); under a preference objective the batch sizes count pairs
    objective: str = "sft"
    sample_every: int = 0  # generate from sample.prompts every N steps (and at 0 and the last): samples.jsonl; 0 = off
    # run `megaft-eval` (eval.*) after training: the Slurm launcher submits it as a job that runs after
    # this one succeeds (--dependency=afterok), a local run runs it when it finished; docs/evaluation.md
    then_eval: bool = False


def accumulation_steps(cfg: TrainConfig, dp: int) -> int:
    """Micro-batches per rank per optimizer step: global / (micro * dp)."""
    return cfg.global_batch_size // (cfg.micro_batch_size * dp)


def check_train(cfg: TrainConfig, dp: int) -> list[str]:
    errors = []
    for name in ("micro_batch_size", "global_batch_size", "eval_every", "eval_batch_size"):
        errors += at_least(cfg, f"train.{name}", 1)
    errors += check_length(cfg)
    errors += at_least(cfg, "train.save_every", 0, "(0 = none between, train.save_final)", "e.g. train.save_every=100")
    errors += at_least(cfg, "train.keep_last", 0, "(0 = keep every checkpoint)", "e.g. train.keep_last=2")
    errors += at_least(cfg, "train.peak_tflops", 0, "(0 = the device table)", "e.g. train.peak_tflops=989")
    errors += at_least(cfg, "train.max_bad_steps", 0, "(0 = never abort)", "e.g. train.max_bad_steps=10")
    errors += at_least(cfg, "train.straggler_every", 0, "(0 = off)", "e.g. train.straggler_every=50")
    errors += at_least(cfg, "train.sample_every", 0, "(0 = off)", "e.g. train.sample_every=100")
    if cfg.straggler_factor <= 1:
        errors.append(f"train.straggler_factor={cfg.straggler_factor} must be > 1 (times the median step "
                      "time); fix: e.g. train.straggler_factor=1.5")
    if not errors and dp >= 1 and cfg.global_batch_size % (cfg.micro_batch_size * dp):
        errors.append(
            f"train.global_batch_size={cfg.global_batch_size} is not a multiple of "
            f"train.micro_batch_size * dp = {cfg.micro_batch_size} * {dp}; fix: make it one, e.g. "
            f"{cfg.micro_batch_size * dp * max(1, cfg.global_batch_size // (cfg.micro_batch_size * dp))}")
    return errors + check_tensorboard(cfg.tensorboard)


def check_length(cfg: TrainConfig) -> list[str]:
    """train.max_steps or train.epochs: exactly one sizes the run."""
    if cfg.max_steps is not None and cfg.epochs is not None:
        return [f"train.max_steps={cfg.max_steps} and train.epochs={cfg.epochs} are both set (a recipe may set "
                "one); fix: null the other: train.max_steps=null to train for epochs, train.epochs=null for steps"]
    if cfg.epochs is not None:
        return [] if cfg.epochs > 0 else [f"train.epochs={cfg.epochs} must be > 0; fix: e.g. train.epochs=1"]
    if cfg.max_steps is None:
        return ["train.max_steps and train.epochs are both null: nothing sizes the run; fix: train.epochs=E "
                "(passes over the data) or train.max_steps=N"]
    return at_least(cfg, "train.max_steps", 0, "(0 = only evaluate)")


TENSORBOARD_CHOICES = ("auto", "true", "false")


def tensorboard_available() -> bool:
    """Whether torch.utils.tensorboard can write (it needs the tensorboard package);
    looked up without importing it (validation stays fast)."""
    return importlib.util.find_spec("tensorboard") is not None


def tensorboard_setting(value: Any) -> str:
    """train.tensorboard as one of TENSORBOARD_CHOICES (YAML turns true/false into bools)."""
    return str(value).lower()


def check_tensorboard(value: Any) -> list[str]:
    """Problems of train.tensorboard: an unknown value, or true without the package."""
    setting = tensorboard_setting(value)
    if setting not in TENSORBOARD_CHOICES:
        return [f"train.tensorboard={value!r} is unknown; fix: auto, true or false"]
    if setting == "true" and not tensorboard_available():
        return ["train.tensorboard=true but the tensorboard package is not installed; fix: pip install "
                "tensorboard, or train.tensorboard=auto (write event files only when it is installed)"]
    return []


def use_tensorboard(value: Any) -> bool:
    setting = tensorboard_setting(value)
    return setting == "true" or (setting == "auto" and tensorboard_available())


@dataclass
class SampleConfig:
    """What `train.sample_every` generates (docs/samples.md)."""

    # JSONL of prompts: {"prompt": str} (encoded as is) or {"messages": [...]} (the run's chat template,
    # with the generation prompt); needed when train.sample_every > 0
    prompts: Optional[str] = None
    max_new_tokens: int = 64  # tokens generated per prompt at most (fewer at eos or model.max_seq_len)
    temperature: float = 0.0  # 0 = greedy; > 0: logits / temperature, then a multinomial draw
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with probability >= top_p (1 = all)
    seed: int = 0  # the draws' seed, combined with the step: every rank draws the same tokens
