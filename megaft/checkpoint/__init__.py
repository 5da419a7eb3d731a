"""Checkpoints: per-rank shards, a manifest with checksums written last, atomic publish, resume.

See megaft.checkpoint.io (the files on disk), megaft.checkpoint.state (what a
rank saves and the protocol across ranks), megaft.checkpoint.writer (sync or
background saves, `train.async_save`) and megaft.checkpoint.reshard (loading at
another tp/pp/dp or ZeRO stage).
"""
from megaft.checkpoint.io import CheckpointWarning, find_latest, list_checkpoints, problem, step_dir
from megaft.checkpoint.state import LayoutMismatchError, ModelMismatchError, capture, load_latest, save, trim_metrics
from megaft.checkpoint.writer import CheckpointWriter

__all__ = [
    "CheckpointWarning", "CheckpointWriter", "LayoutMismatchError", "ModelMismatchError", "capture", "find_latest",
    "list_checkpoints", "load_latest", "problem", "save", "step_dir", "trim_metrics",
]
