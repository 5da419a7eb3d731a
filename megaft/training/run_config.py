"""RUN_DIR/config.yaml: the config a run actually ran with.

Hydra saves the config it composed (.hydra/config.yaml) before anything is resolved. What
ran can differ: `resolve` fills the architecture and vocabulary from files, an elastic
restart sets parallel.dp to the world it got (megaft.launch.elastic), a re-plan replaces
the layout (megaft.plan.replan), and an unset parallel.dp follows the world. The trainer's
rank 0 writes this file when a run (or a restarted attempt) starts, so it is always the
latest attempt's; megaft-report (--commbench) and an elastic resume read it.

The file is the Config as YAML, with parallel.dp as the grid has it, plus one mapping that is
not a config field, `derived` (world_size and accumulation_steps, the micro-batches per rank
per optimizer step; for a run sized by train.epochs, `epochs`: the epochs and the steps they
resolved to, which a restarted run reads back: `stored_epoch_steps`), which `read_run_config`
sets apart.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import os
import typing
from dataclasses import dataclass
from typing import Optional

import yaml
from omegaconf import OmegaConf
from omegaconf._utils import get_omega_conf_dumper

from megaft.config import Config
from megaft.config.train import accumulation_steps
from megaft.run_dir import CONFIG

FILE = CONFIG
DERIVED = "derived"
EPOCHS = "epochs"  # derived's entry of a run sized by train.epochs
HEADER = ("# The config this run ran with: resolved, after any elastic change or re-plan\n"
          "# (megaft.training.run_config). `derived` is not a setting: what the layout implies.\n")


@dataclass(frozen=True)
class RunConfig:
    """A run directory's config.yaml: the Config and what it implied on its world."""

    config: Config
    world_size: int
    accumulation_steps: int  # micro-batches per rank per optimizer step


def ran_config(cfg: Config, world_size: int, dp: int) -> RunConfig:
    """`cfg` as it runs on a grid of `world_size` ranks with `dp` data-parallel replicas (a copy:
    parallel.dp set, `cfg` untouched)."""
    ran = copy.deepcopy(cfg)
    ran.parallel.dp = dp
    return RunConfig(ran, world_size, accumulation_steps(ran.train, dp))


def write_run_config(run_dir: str, run: RunConfig) -> str:
    """run_dir/config.yaml (replaced whole: a reader never sees half of it); its path."""
    path = os.path.join(run_dir, FILE)
    derived = {DERIVED: {"world_size": run.world_size, "accumulation_steps": run.accumulation_steps,
                         **epochs_record(run.config)}}
    text = HEADER + config_yaml(run.config) + yaml.safe_dump(derived, sort_keys=False)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return path


def config_yaml(cfg: Config) -> str:
    """`OmegaConf.to_yaml(OmegaConf.structured(cfg))`'s text, made from the dataclasses directly: the
    structured copy cost ~40 ms of a tiny run's ~400 (every test run and every restart writes one)."""
    return yaml.dump(_plain(cfg, type(cfg)), default_flow_style=False, allow_unicode=True, sort_keys=False,
                     Dumper=get_omega_conf_dumper())


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _plain(value, hint):
    """`value` as OmegaConf's container holds it: dataclasses as dicts, enums by name, tuples as lists,
    an int in a float field as a float (OmegaConf converts it on assignment)."""
    if dataclasses.is_dataclass(value):
        hints = _hints(type(value))
        return {f.name: _plain(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if typing.get_origin(hint) is typing.Union:  # Optional[X] -> X
        hint = next((a for a in typing.get_args(hint) if a is not type(None)), None)
    args = typing.get_args(hint)
    if isinstance(value, (list, tuple)):
        return [_plain(v, args[0] if args else None) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v, args[1] if len(args) == 2 else None) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def epochs_record(cfg: Config) -> dict:
    """derived's `epochs` entry of a run sized by train.epochs (resolved: train.max_steps set), else nothing."""
    t = cfg.train
    if t.epochs is None or t.max_steps is None:
        return {}
    return {EPOCHS: {"epochs": t.epochs, "global_batch_size": t.global_batch_size, "max_steps": t.max_steps}}


def stored_epoch_steps(run_dir: str, epochs: float, global_batch_size: int) -> Optional[int]:
    """The steps run_dir/config.yaml resolved train.epochs to, when that run had these epochs and
    global batch (a restarted attempt keeps its epoch boundaries), else None."""
    path = os.path.join(run_dir, FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        record = ((yaml.safe_load(f) or {}).get(DERIVED) or {}).get(EPOCHS) or {}
    if record.get("epochs") != epochs or record.get("global_batch_size") != global_batch_size:
        return None
    return int(record["max_steps"])


def load_config(path: str) -> Config:
    """The Config in a YAML file: this module's config.yaml or Hydra's .hydra/config.yaml
    (keys that are not config fields, like `derived`, are dropped)."""
    raw = OmegaConf.load(path)
    known = {k: v for k, v in raw.items() if k in Config.__dataclass_fields__}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), known))


def read_run_config(run_dir: str) -> Optional[RunConfig]:
    """run_dir/config.yaml, or None when the run wrote none (it started before this file existed)."""
    path = os.path.join(run_dir, FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        derived = (yaml.safe_load(f) or {}).get(DERIVED) or {}
    cfg = load_config(path)
    dp = cfg.parallel.dp or 1
    return RunConfig(cfg, int(derived.get("world_size", dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)),
                     int(derived.get("accumulation_steps", accumulation_steps(cfg.train, dp))))
