"""`megaft-train`: the Hydra entry point. It validates the config once, then starts
the ranks (local launcher) or, under torchrun, runs this process's rank."""
from __future__ import annotations

import logging
import os
import sys
from importlib.resources import files

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from megaft.config import Config, ConfigError, check_local_launch, register_configs, validate

log = logging.getLogger("megaft")
register_configs()


def conf_dir() -> str:
    """conf/ of the source tree, or the copy installed as the package megaft.conf."""
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    return source if os.path.isdir(source) else str(files("megaft.conf"))


def run(cfg: Config, run_dir: str) -> None:
    """Validate, then train in `run_dir`; raises ConfigError listing every problem."""
    from megaft.launch.env import external_env

    env = external_env()
    world = env.world_size if env else cfg.launcher.nproc
    problems = validate(cfg, world) + ([] if env else check_local_launch(cfg))
    if problems:
        raise ConfigError(problems)
    os.makedirs(run_dir, exist_ok=True)
    if env is not None:
        from megaft.launch.rank import run_rank

        run_rank(cfg, run_dir, env)
    else:
        from megaft.launch.local import launch_local

        launch_local(cfg, run_dir)


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="train")
def _hydra_main(dcfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dcfg)
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        run(cfg, run_dir)
    except ConfigError as exc:
        print(f"megaft-train: {exc}", file=sys.stderr)
        sys.exit(2)
    log.info("run directory: %s", run_dir)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
