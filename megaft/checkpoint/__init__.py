"""Checkpoints: per-rank shards, a manifest with checksums written last, atomic publish, resume.

See megaft.checkpoint.io (the files on disk) and megaft.checkpoint.state (what a
rank saves and the protocol across ranks). Resharding to another tp/dp/pp, async
save and ZeRO-sharded optimizer states are not implemented yet.
"""
from megaft.checkpoint.io import CheckpointWarning, find_latest, list_checkpoints, problem, step_dir
from megaft.checkpoint.state import LayoutMismatchError, capture, load_latest, save, trim_metrics

__all__ = [
    "CheckpointWarning", "LayoutMismatchError", "capture", "find_latest", "list_checkpoints", "load_latest",
    "problem", "save", "step_dir", "trim_metrics",
]
