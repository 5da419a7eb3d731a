"""The run directory's contract (docs/architecture.md): the names of the files every tool reads,
and what makes a directory a run directory. Stdlib only, so any layer may ask."""
from __future__ import annotations

import os

SUMMARY = "summary.json"  # one RunSummary (megaft.training.summary)
CONFIG = "config.yaml"  # the config that ran (megaft.training.run_config)
METRICS = "metrics.jsonl"  # one JSON object per line (megaft.training.metrics)
# What makes a directory a run dir: any of these (a run killed before its first line still has Hydra's)
RUN_FILES = (SUMMARY, METRICS, CONFIG, os.path.join(".hydra", "config.yaml"))


def is_run_dir(path: str) -> bool:
    """Whether `path` holds one of RUN_FILES."""
    return any(os.path.isfile(os.path.join(path, f)) for f in RUN_FILES)
