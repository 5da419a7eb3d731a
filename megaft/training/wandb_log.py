"""Weights & Biases (`logger=wandb`, settings in `wandb.*`): the scalars TensorBoard gets,
the config that ran and the run's summary, sent by rank 0 to one W&B run per attempt.

`wandb.mode=offline` writes the run under RUN_DIR/wandb/offline-run-*/ (no network);
`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later. The run's name is wandb.name,
else, under a Hydra multirun, the point's overrides that the sweep varies (`train.seed=1`
of `train.seed=0,1`; RUN_DIR/.hydra/overrides.yaml against the sweep's multirun.yaml),
else the run directory's name; a multirun's points share one W&B group, the sweep dir
(its last two path parts, e.g. `2026-11-27/14-03-22`), unless wandb.group names one.
"""
from __future__ import annotations

import html
import os
from typing import Any, Optional

import yaml

from megaft.config.wandb import WandbConfig

# what marks a run dir's parent as a Hydra multirun's sweep dir (Hydra's sweeper; megaft's Slurm launcher)
SWEEP_FILES = ("multirun.yaml", "submitted.json")


def _sweep_dir(run_dir: str) -> Optional[str]:
    parent = os.path.dirname(os.path.abspath(run_dir))
    return parent if any(os.path.isfile(os.path.join(parent, f)) for f in SWEEP_FILES) else None


def _read_yaml(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def swept_overrides(point: list[str], sweep_dir: str) -> list[str]:
    """The overrides of a multirun point that the sweep varies (`train.seed=0` of `train.seed=0,1`),
    from the sweep's multirun.yaml; all of `point` when it names none."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    task = ((_read_yaml(os.path.join(sweep_dir, "multirun.yaml")) or {}).get("hydra") or {}).get("overrides", {})
    parser = OverridesParser.create()
    try:
        swept = {o.key_or_group for o in parser.parse_overrides(list(task.get("task") or [])) if o.is_sweep_override()}
        picked = [text for text, o in zip(point, parser.parse_overrides(point)) if o.key_or_group in swept]
    except OverrideParseException:  # one Hydra cannot parse here: name the run by all of them
        return point
    return picked or point


def run_identity(cfg: WandbConfig, run_dir: str) -> tuple[str, Optional[str]]:
    """(name, group) of the W&B run of `run_dir` (the module docstring tells the defaults)."""
    sweep = _sweep_dir(run_dir)
    name = cfg.name
    if not name and sweep:
        point = _read_yaml(os.path.join(run_dir, ".hydra", "overrides.yaml")) or []
        name = " ".join(swept_overrides([str(o) for o in point], sweep))
    name = name or os.path.basename(os.path.abspath(run_dir))
    group = cfg.group or (os.path.join(*sweep.split(os.sep)[-2:]) if sweep else None)
    return name, group


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line that TensorBoard gets too (not the step, not flags)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbLog:
    """One W&B run: `write` takes metrics.jsonl lines, `text` generated samples, `summary`
    the finished run's summary; `close` finishes the run (offline: the folder is complete)."""

    def __init__(self, cfg: WandbConfig, run_dir: str, config: dict[str, Any]):
        import wandb

        name, group = run_identity(cfg, run_dir)
        self._wandb = wandb
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=str(cfg.mode), name=name, group=group,
                              tags=list(cfg.tags) or None, dir=run_dir, config=config, job_type="train",
                              reinit="finish_previous")

    def write(self, record: dict[str, Any]) -> None:
        scalars = _scalars(record)
        if scalars and "step" in record:
            self.run.log(scalars, step=record["step"])

    def text(self, step: int, tag: str, text: str) -> None:
        """A text entry at `step` (MetricsLog.text: samples while training), as preformatted HTML."""
        self.run.log({tag: self._wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        # Commit the last step's row first: committing it later would set its values (the last
        # step's tokens/s, ...) over the run's own in W&B's summary.
        self.run.log({}, commit=True)
        self.run.summary.update(values)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def read_config_file(path: str) -> dict[str, Any]:
    """A run's config.yaml (megaft.training.run_config) as the plain dict W&B records."""
    with open(path) as f:
        return yaml.safe_load(f) or {}
