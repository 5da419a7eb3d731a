"""`logger` and `wandb.*` (Weights & Biases: megaft.training.wandb_log sends the run), and
their validation before any rank starts: in the config layer, apart from the code."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional


class Logger(StrEnum):
    """`logger`: where metrics also go beside metrics.jsonl and TensorBoard."""

    none = "none"
    wandb = "wandb"


class WandbMode(StrEnum):
    """`wandb.mode`, as wandb.init takes it."""

    online = "online"  # needs `wandb login` or WANDB_API_KEY
    offline = "offline"  # RUN_DIR/wandb/offline-run-*; `wandb sync` later
    disabled = "disabled"  # wandb's no-op run


@dataclass
class WandbConfig:
    """Where `logger=wandb` sends a run (docs/running-and-slurm.md#weights--biases)."""

    project: str = "megaft"  # the W&B project runs go to
    entity: Optional[str] = None  # team or user; None = the logged-in user's default entity
    # online (needs `wandb login` or WANDB_API_KEY) | offline (RUN_DIR/wandb; `wandb sync` later) | disabled
    mode: WandbMode = WandbMode.online
    name: Optional[str] = None  # run name; None = the overrides the sweep varies, else the run dir's name
    group: Optional[str] = None  # None = the sweep dir under a multirun (every point in one group), else none
    tags: list[str] = field(default_factory=list)  # W&B tags of the run, e.g. wandb.tags=[sft,llama]


def wandb_available() -> bool:
    """Whether the wandb package is installed, looked up without importing it."""
    return importlib.util.find_spec("wandb") is not None


def check_logger(logger: str, cfg: WandbConfig) -> list[str]:
    """Problems of `logger` and, with logger=wandb, of `wandb.*`: checked before any rank starts."""
    if logger not in set(Logger):  # a Config built in Python: Hydra checked the YAML/CLI ones
        return [f"logger={logger!r} is unknown; fix: logger=none or logger=wandb"]
    if logger != "wandb":
        return []
    problems = []
    if not wandb_available():
        problems.append("logger=wandb but the wandb package is not installed; fix: pip install wandb "
                        "(requirements.txt pins the tested version), or logger=none")
    if cfg.mode not in set(WandbMode):
        problems.append(f"wandb.mode={cfg.mode!r} is unknown; fix: online, offline (sync later with "
                        "`wandb sync RUN_DIR/wandb/offline-run-*`) or disabled")
    if not cfg.project:
        problems.append("wandb.project is empty; fix: e.g. wandb.project=megaft")
    return problems
