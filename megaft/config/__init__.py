"""The configuration schema: the root `Config`, one dataclass module per section, Hydra's
ConfigStore registration and composition, and each section's pure checks.

A leaf package: it imports neither torch nor any other package of megaft, so a config can be
composed, printed and checked (megaft-plan, `megaft-train --cfg job`) without the training
stack. Checks that read files, need a model family's spec or the performance model sit above
it (megaft.validation.validate).

    config/root.py      Config, Precision, Device, ConfigError
    config/compose.py   register_configs, conf_dir, compose_config, compose_once
    config/<section>.py model, moe, parallel, optim, data, train (+ sample), launcher, kernels,
                        verify, cluster (+ plan), commbench, lora, pref, rl, reward, distill, wandb, eval
"""
from megaft.config.compose import compose_config, compose_once, conf_dir, register_configs
from megaft.config.root import Config, ConfigError, Device, Precision

__all__ = ["Config", "ConfigError", "Device", "Precision", "compose_config", "compose_once", "conf_dir",
           "register_configs"]
