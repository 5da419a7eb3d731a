"""Hydra's side of the config: the `base_<group>` schemas in the ConfigStore (conf/<group>/*.yaml
extend them), the conf/ tree's location, and composing a Config from overrides."""
from __future__ import annotations

import os
from importlib.resources import files

from megaft.config.cluster import ClusterConfig
from megaft.config.commbench import CommbenchConfig
from megaft.config.data import DataConfig
from megaft.config.kernels import KernelsConfig
from megaft.config.launcher import LauncherConfig
from megaft.config.lora import LoraConfig
from megaft.config.model import ModelConfig
from megaft.config.optim import OptimConfig
from megaft.config.parallel import ParallelConfig
from megaft.config.root import Config
from megaft.config.verify import VerifyConfig


def register_configs() -> None:
    """The root schema as `base_config` and each group's as `base_<group>`."""
    from hydra.core.config_store import ConfigStore  # on use: a config can be built without Hydra

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in (("model", ModelConfig), ("parallel", ParallelConfig), ("optim", OptimConfig),
                        ("data", DataConfig), ("launcher", LauncherConfig), ("kernels", KernelsConfig),
                        ("verify", VerifyConfig), ("cluster", ClusterConfig),
                        ("commbench", CommbenchConfig), ("lora", LoraConfig)):
        cs.store(group=group, name=f"base_{group}", node=node)


def conf_dir() -> str:
    """conf/ of the source tree, or the copy installed as the package megaft.conf: the config
    tree of megaft-train, which every tool composes its config from."""
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")
    return source if os.path.isdir(source) else str(files("megaft.conf"))


def compose_config(overrides: list[str]) -> Config:
    """megaft-train's Config for `overrides` (the same config tree and validation of values),
    for tools that read a config without being a Hydra app (megaft-scale, megaft-report)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return OmegaConf.to_object(compose("train", overrides=overrides))


def compose_once(hydra_main, argv: list[str]) -> None:
    """Run a @hydra.main function composing the config once, not twice.

    Before it runs an app, Hydra composes the whole config a first time only to read
    `hydra.mode` (Hydra.get_mode); no file of conf/ sets it (tests/test_config_compose.py
    checks), so unless the command line does, that composition can only answer None, which
    Hydra then reads as --run, or --multirun with -m. It is a fifth of megaft-plan's wall
    time. Skipped here for this call only; a command line that sets hydra.mode keeps it."""
    from hydra._internal.hydra import Hydra

    if any(a.lstrip("+~").startswith("hydra.mode") for a in argv):
        return hydra_main()
    get_mode = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None
    try:
        return hydra_main()
    finally:
        Hydra.get_mode = get_mode
