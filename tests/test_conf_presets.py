"""The YAML presets set values; the dataclasses own the defaults (one source of truth).

A preset that restates a default hides a later change of that default and drifts
(conf/train.yaml once said max_steps: 250 where TrainConfig said 300), so every value
a preset writes must differ from its schema's default."""
from __future__ import annotations

import dataclasses
import glob
import os

from omegaconf import OmegaConf

from megaft.config import Config

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def restated(values: dict, schema, where: str) -> list[str]:
    """The keys of `values` equal to `schema`'s defaults (recursing into nested configs)."""
    out, fields = [], {f.name: f for f in dataclasses.fields(schema)}
    for key, value in values.items():
        if key not in fields:
            continue  # unknown keys are Hydra's error, caught when composing
        default = getattr(schema(), key)
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            out += restated(value, type(default), f"{where}{key}.")
        elif value == default and not isinstance(value, dict):
            out.append(f"{where}{key}: {value!r}")
    return out


def load(path: str) -> dict:
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    data.pop("defaults", None)
    data.pop("hydra", None)
    return data


def test_no_preset_restates_a_default():
    problems = restated(load(os.path.join(CONF, "train.yaml")), Config, "train.yaml: ")
    groups = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)
              if dataclasses.is_dataclass(getattr(Config(), f.name))}
    for path in sorted(glob.glob(os.path.join(CONF, "*", "*.yaml"))):
        group = os.path.basename(os.path.dirname(path))
        if group in groups:
            problems += restated(load(path), groups[group], f"{os.path.relpath(path, CONF)}: ")
    assert problems == [], "\n".join(problems)


def test_the_check_sees_a_restated_default():
    assert restated({"train": {"max_steps": Config().train.max_steps, "seed": 7}}, Config, "") == \
        [f"train.max_steps: {Config().train.max_steps}"]
