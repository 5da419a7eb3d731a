"""`megaft-commbench`: the Hydra app. Same config tree and overrides as megaft-train, so the
ranks sit where training's would (launcher.nproc locally, one per task under srun, or
torchrun's). Prints the table, writes commbench.json/.csv/.png in the run directory, and
exits 0, 1 on a wrong result (or, with commbench.check=true, a slow node pair or a
collective below commbench.min_busbw_gbps, each named), 2 on a bad config."""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from megaft.commbench.ep import ep_problems
from megaft.commbench.report import format_table
from megaft.commbench.verdict import verdict
from megaft.config import Config, ConfigError, compose_once, conf_dir, register_configs
from megaft.config.commbench import check_commbench
from megaft.config.launcher import check_launcher
from megaft.config.parallel import check_parallel
from megaft.device import resolve_device
from megaft.launch.env import DistEnv
from megaft.validation import check_local_launch

register_configs()


def check(cfg: Config, world_size: int, *, local: bool) -> list[str]:
    """The problems commbench can have: its own keys, the grid over `world_size` ranks, the launcher,
    and under parallel.ep > 1 the mixture of experts whose all-to-all it sizes. The rest of
    megaft-train's model, data and memory checks do not apply: nothing is trained."""
    import torch

    problems = check_commbench(cfg.commbench, resolve_device(cfg.device)) + check_parallel(cfg.parallel, world_size)
    problems += ep_problems(cfg)
    problems += check_launcher(cfg.launcher) + (check_local_launch(cfg) if local else [])
    if cfg.device == "cuda" and not torch.cuda.is_available():
        problems.append("device=cuda but torch sees no CUDA GPU; fix: device=cpu (gloo) or a CUDA build of torch")
    return problems


def run(cfg: Config, run_dir: str, *, env: Optional[DistEnv] = None, worker=None) -> int:
    """Validate, measure, report; the exit status. Local ranks (env None) are started here with
    `worker` (default megaft.commbench.run.local_worker; tests bind hooks to it); under
    torchrun/srun this process is rank env.rank; rank 0 prints and returns the verdict, the others 0."""
    problems = check(cfg, env.world_size if env else cfg.launcher.nproc, local=env is None)
    if problems:
        raise ConfigError(problems)
    os.makedirs(run_dir, exist_ok=True)
    if env is None:
        from megaft.commbench.run import local_worker
        from megaft.launch.local import launch_local

        launch_local(cfg, run_dir, worker=worker or local_worker)
        with open(os.path.join(run_dir, "commbench.json")) as f:
            doc, reporter = json.load(f), True
    else:
        from megaft.commbench.run import run_rank

        doc, reporter = run_rank(cfg, run_dir, env), env.rank == 0
    if not reporter:
        # Rank 0 carries the verdict: srun and torchrun fail the step when one task fails, and a
        # failing rank 1 would make torchrun kill rank 0 before it prints the table.
        return 0
    status, problems = verdict(doc, cfg.commbench)
    print(format_table(doc), flush=True)
    for p in problems:
        print(f"megaft-commbench: FAIL: {p}", flush=True)
    print(f"megaft-commbench: {'PASS' if status == 0 else 'FAIL'}; "
          f"{json.dumps(os.path.join(run_dir, 'commbench.json'))}", flush=True)
    return status


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="train")
def _hydra_main(dcfg: DictConfig) -> None:
    from megaft.launch.env import external_env

    cfg: Config = OmegaConf.to_object(dcfg)
    try:
        status = run(cfg, HydraConfig.get().runtime.output_dir, env=external_env())
    except ConfigError as exc:
        print(f"megaft-commbench: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status)


class CommbenchFailed(RuntimeError):
    """A Slurm commbench job whose check failed (a wrong result, a slow pair, a slow collective)."""


def slurm_body(cfg: Config, run_dir: str, env: DistEnv, threads: int) -> dict:
    """The Slurm task of `megaft-commbench -m hydra/launcher=slurm...` (megaft.launch.submit_task):
    each task is one rank, placed as training's would be; rank 0 reports, and a failed check
    fails the job."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    status = run(cfg, run_dir, env=env)
    if env.rank == 0 and status != 0:
        raise CommbenchFailed(f"megaft-commbench failed (exit status {status}); see {run_dir}/commbench.json")
    return {"status": status}


SLURM_TASK_BODY = slurm_body  # what each Slurm task runs under hydra/launcher=slurm (megaft_slurm_launcher)


def main() -> None:
    compose_once(_hydra_main, sys.argv[1:])


if __name__ == "__main__":
    main()
