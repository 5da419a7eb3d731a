"""`megaft-train`: the Hydra entry point. It validates the config once, then starts
the ranks (local launcher) or, under torchrun, runs this process's rank."""
from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from megaft.config import Config, ConfigError, compose_once, conf_dir, register_configs
from megaft.config.optim import pretrained_lr_warning
from megaft.launch.runlock import RunLockedError
from megaft.validation import check_local_launch, validate

log = logging.getLogger("megaft")
register_configs()


def prepare_data(cfg: Config, *, progress: bool) -> None:
    """Tokenize file data for packing=docs|none, or preference pairs, into the prepared store once, before any rank
    joins a collective: here in the launcher, or (torchrun/srun) in every rank's process,
    where a file lock lets one prepare and the others wait (megaft.data.prepare)."""
    from megaft.config.data import data_sources
    from megaft.config.pref import reads_pairs
    from megaft.data.prepare import prepare_dataset
    from megaft.models.vision.checks import trains_images

    if not data_sources(cfg.data) or trains_images(cfg):  # image chats: every rank reads them in memory
        return
    if reads_pairs(cfg.train.objective):  # pairs always come from the store (megaft.pref.store)
        from megaft.pref.store import prepare_pairs

        prepare_pairs(cfg.data, init_from=cfg.model.init_from, eos_token_id=cfg.model.extra.get("eos_token_id"),
                      progress=progress)
    elif cfg.data.packing != "stream":
        prepare_dataset(cfg.data, init_from=cfg.model.init_from, eos_token_id=cfg.model.extra.get("eos_token_id"),
                        progress=progress)


def prepare_run(cfg: Config, run_dir: str, world: int, *, speaks: bool = True, extra: Sequence[str] = ()) -> None:
    """What happens once before the ranks start, after any elastic change of the layout: validate
    (a ConfigError naming every problem, `extra` ones included), warn about a pretrained model at
    the demo's learning rate, prepare the data and resolve train.epochs into train.max_steps
    (`cfg` in place). `speaks`: this process logs (one per run, under torchrun/srun rank 0)."""
    from megaft.training.epochs import resolve_epochs

    problems = validate(cfg, world) + list(extra)
    warning = pretrained_lr_warning(cfg.optim, init_from=cfg.model.init_from, conf=conf_dir())
    if warning and speaks:
        log.warning("megaft: %s", warning)
    if problems:
        raise ConfigError(problems)
    os.makedirs(run_dir, exist_ok=True)
    prepare_data(cfg, progress=speaks)
    epochs = resolve_epochs(cfg, run_dir)  # on the prepared data, or as config.yaml recorded it
    if epochs is not None and speaks:
        log.info("megaft: %s", epochs.describe(cfg.train.global_batch_size))


def run(cfg: Config, run_dir: str) -> None:
    """Validate, then train in `run_dir`; raises ConfigError listing every problem."""
    from megaft.launch.env import external_env

    env = external_env()
    world = env.world_size if env else cfg.launcher.nproc
    if cfg.launcher.elastic:  # dp follows the world this (re)start got (megaft.launch.elastic)
        from megaft.launch.elastic import ElasticError, adapt

        try:
            adapt(cfg, world, run_dir)
        except ElasticError as exc:  # tp*pp*cp no longer divide the world: the planner, if a cluster is named
            from megaft.plan.replan import replan

            if replan(cfg, world, str(exc)) is None:
                raise ConfigError([f"{exc}; or name a cluster (cluster=<preset>, conf/cluster/) so the "
                                   "planner re-plans the layout"]) from exc
    prepare_run(cfg, run_dir, world, speaks=env is None or env.rank == 0,
                extra=[] if env else check_local_launch(cfg))
    if env is not None:
        from megaft.launch.rank import run_rank
        from megaft.launch.runlock import run_lock
        from megaft.launch.stopped import RunStoppedError, stopped_message

        with run_lock(run_dir, enabled=env.rank == 0):  # one run per run directory (rank 0 holds it)
            summary = run_rank(cfg, run_dir, env)
        if summary.get("stopped_by"):  # saved, not finished: every rank exits EXIT_STOPPED
            raise RunStoppedError(stopped_message(summary))
    else:
        from megaft.launch.local import launch_local

        launch_local(cfg, run_dir)
        if cfg.train.then_eval and os.path.isfile(os.path.join(run_dir, "summary.json")):  # finished
            evaluate_after(cfg, run_dir)


def evaluate_after(cfg: Config, run_dir: str) -> None:
    """train.then_eval after a local run: megaft-eval on the run dir, here (the Slurm launcher
    queues it as a job of its own instead: megaft.eval.submit)."""
    from megaft.eval.model_dir import EvalError, locate
    from megaft.eval.run import evaluate

    log.info("train.then_eval: megaft-eval %s (eval.tasks=%s)", run_dir, list(cfg.eval.tasks))
    try:
        evaluate(locate(run_dir), cfg.eval)
    except EvalError as exc:  # the run itself finished and is saved
        print(f"megaft-train: train.then_eval: {exc}", file=sys.stderr)
        sys.exit(1)


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="train")
def _hydra_main(dcfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dcfg)
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        run(cfg, run_dir)
    except (ConfigError, RunLockedError) as exc:  # before any rank started: no traceback
        print(f"megaft-train: {exc}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as exc:
        from megaft.launch.local import InterruptedRunError
        from megaft.launch.stopped import EXIT_STOPPED, RunStoppedError

        if isinstance(exc, RunStoppedError):
            print(f"megaft-train: {exc}", file=sys.stderr)
            sys.exit(EXIT_STOPPED)
        if not isinstance(exc, InterruptedRunError):
            raise
        print(f"megaft-train: {exc}", file=sys.stderr)
        sys.exit(130)  # the shell's code for a run ended by SIGINT
    log.info("run directory: %s", run_dir)


def main() -> None:
    compose_once(_hydra_main, sys.argv[1:])


if __name__ == "__main__":
    main()
