"""Checkpoints: per-rank shards, a manifest with checksums written last, atomic publish, resume.

See megaft.checkpoint.io (the files on disk), megaft.checkpoint.state (what a
rank saves and the protocol across ranks), megaft.checkpoint.writer (sync or
background saves, `train.async_save`) and megaft.checkpoint.reshard (loading at
another tp/pp/dp or ZeRO stage).
"""
import importlib

from megaft.checkpoint.io import CheckpointWarning, find_latest, list_checkpoints, problem, step_dir

# state and writer import torch: loaded on first use, so that io's readers (the launcher's elastic
# restart, megaft-report) start without it
_LAZY = {"LayoutMismatchError": "state", "ModelMismatchError": "state", "capture": "state", "load_latest": "state",
         "save": "state", "trim_metrics": "state", "CheckpointWriter": "writer"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"megaft.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megaft.checkpoint' has no attribute {name!r}")


__all__ = [
    "CheckpointWarning", "CheckpointWriter", "LayoutMismatchError", "ModelMismatchError", "capture", "find_latest",
    "list_checkpoints", "load_latest", "problem", "save", "step_dir", "trim_metrics",
]
