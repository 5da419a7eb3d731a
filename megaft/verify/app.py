"""`megaft-verify`: the Hydra app. Same config tree and overrides as megaft-train; prints
the per-step comparison, writes verify.json in the run directory, and exits 0 when the
layout equals the single process within tolerance, 1 when it does not, 2 on a bad config."""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from megaft.config import Config, ConfigError, compose_once, conf_dir, register_configs
from megaft.verify.run import run_verify, slurm_body, write_report

register_configs()
SLURM_TASK_BODY = slurm_body  # what each Slurm task runs under hydra/launcher=slurm (megaft_slurm_launcher)


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="train")
def _hydra_main(dcfg: DictConfig) -> None:
    from megaft.launch.env import external_env
    from megaft.launch.stopped import EXIT_STOPPED, RunStoppedError

    cfg: Config = OmegaConf.to_object(dcfg)
    run_dir = HydraConfig.get().runtime.output_dir
    os.makedirs(run_dir, exist_ok=True)
    try:
        report = run_verify(cfg, run_dir, env=external_env())
    except ConfigError as exc:
        print(f"megaft-verify: {exc}", file=sys.stderr)
        sys.exit(2)
    except RunStoppedError as exc:  # a signal stopped the ranks: not verified, as megaft-train says it
        print(f"megaft-verify: {exc}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)
    if report is None:  # a rank other than 0 under torchrun/srun: rank 0 reports
        return
    print(f"megaft-verify: wrote {write_report(report, run_dir)}", flush=True)
    sys.exit(0 if report.passed else 1)


def main() -> None:
    compose_once(_hydra_main, sys.argv[1:])


if __name__ == "__main__":
    main()
