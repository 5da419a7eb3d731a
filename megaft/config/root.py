"""The run's root Config: one field per section (each section's dataclass in its own module of
megaft.config), the compute precision and device, and ConfigError."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from megaft.config.cluster import ClusterConfig, PlanConfig
from megaft.config.commbench import CommbenchConfig
from megaft.config.data import DataConfig
from megaft.config.distill import DistillConfig
from megaft.config.eval import EvalConfig
from megaft.config.kernels import KernelsConfig
from megaft.config.launcher import LauncherConfig
from megaft.config.lora import LoraConfig
from megaft.config.model import ModelConfig
from megaft.config.moe import MoEConfig
from megaft.config.optim import OptimConfig
from megaft.config.parallel import ParallelConfig
from megaft.config.pref import PrefConfig
from megaft.config.reward import RewardConfig
from megaft.config.rl import RLConfig
from megaft.config.train import SampleConfig, TrainConfig
from megaft.config.verify import VerifyConfig
from megaft.config.wandb import Logger, WandbConfig


class Precision(StrEnum):
    """Compute precision: autocast compute, fp32 weights and loss; fp16 adds loss scaling."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Device(StrEnum):
    auto = "auto"  # cuda when available
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    precision: Precision = Precision.fp32  # fp32 | bf16 | fp16 (Hydra rejects other values when composing)
    device: Device = Device.auto  # auto (cuda when available) | cpu | cuda
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # megaft-verify only
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # megaft-plan only (conf/cluster/)
    plan: PlanConfig = field(default_factory=PlanConfig)  # megaft-plan only
    commbench: CommbenchConfig = field(default_factory=CommbenchConfig)  # megaft-commbench only
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA fine-tuning (megaft.peft); rank 0 = off
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture-of-experts routing (megaft.config.moe)
    pref: PrefConfig = field(default_factory=PrefConfig)  # preference objectives (train.objective; megaft.pref)
    rl: RLConfig = field(default_factory=RLConfig)  # train.objective=grpo (megaft.rl)
    reward: RewardConfig = field(default_factory=RewardConfig)  # train.objective=reward (megaft.config.reward)
    distill: DistillConfig = field(default_factory=DistillConfig)  # train.objective=distill (megaft.distill)
    sample: SampleConfig = field(default_factory=SampleConfig)  # samples while training (train.sample_every)
    # where metrics also go beside metrics.jsonl and TensorBoard (train.tensorboard): none | wandb (settings in
    # wandb.*; rank 0 sends the scalars, the config and the summary: megaft.training.wandb_log)
    logger: Logger = Logger.none
    wandb: WandbConfig = field(default_factory=WandbConfig)  # logger=wandb only
    eval: EvalConfig = field(default_factory=EvalConfig)  # megaft-eval, and train.then_eval's job


class ConfigError(ValueError):
    """Every problem of a config, one per line, each with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))
