"""Checkpoint directories on disk: naming, manifest, checksums, completeness, pruning.

A checkpoint of step N is the directory `checkpoints/step_{N:06d}/` holding one
`rank_{r:05d}.pt` per rank and `manifest.json`. It is written as
`step_{N:06d}.tmp/` and renamed once every shard and then the manifest are on
disk, so a reader never sees the final name on a half-written checkpoint. A
directory counts as complete only when its manifest lists every file with the
size and sha256 that the file really has: that also catches a shard damaged
after the rename (disk, copy, a user's hands). Nothing here talks to other
ranks; megaft.checkpoint.state adds the collectives.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any, Optional

from megaft.fileio import file_sha256, write_json_atomic

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")  # a `.tmp` suffix never matches: unfinished writes are invisible


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (partial or corrupt) and an older one is used."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


class UnsafeCheckpointError(Exception):
    """A shard holds an object outside what torch's weights-only unpickler allows (tensors,
    containers, numbers, strings): loading it could run code, so megaft refuses it. Not a
    ValueError, so no reshard fallback swallows it."""


def load_shard(ckpt_dir: str, rank: int, *, mmap: bool = False) -> dict[str, Any]:
    """Rank `rank`'s shard of `ckpt_dir`, unpickled weights-only: a checkpoint never runs code.
    Every shard megaft ever wrote holds only tensors, dicts, lists, tuples, numbers and strings,
    so old checkpoints load unchanged."""
    import pickle

    import torch

    path = os.path.join(ckpt_dir, shard_name(rank))
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:  # torch names the refused global ("Unsupported global: ...")
        found = re.search(r"(?:Unsupported global|unsupported GLOBAL)[: ]+(?:GLOBAL )?([\w.]+)", str(exc))
        what = found.group(1) if found else str(exc).strip().splitlines()[0][:200]
        raise UnsafeCheckpointError(
            f"{path}: refused: it holds {what}, which is not a tensor, number, string or container, and "
            "unpickling it could run code; megaft never wrote it. fix: resume from a checkpoint megaft saved "
            "(train.resume=false starts afresh; move this checkpoint away)") from None


def _fsync_dir(path: str) -> None:
    # A rename is durable only once the directory holding it is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(tmp_dir: str, step: int, layout: dict[str, int],
                   meta: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Checksum every shard in `tmp_dir` and write manifest.json last (itself via rename);
    `meta` adds keys (the trainer records the model's architecture as "model")."""
    files = {}
    for name in sorted(os.listdir(tmp_dir)):
        if name.startswith("rank_") and name.endswith(".pt"):
            path = os.path.join(tmp_dir, name)
            files[name] = {"bytes": os.path.getsize(path), "sha256": file_sha256(path)}
    manifest = {**(meta or {}), "format": FORMAT_VERSION, "step": step, "layout": layout, "files": files}
    write_json_atomic(os.path.join(tmp_dir, MANIFEST), manifest)
    return manifest


def publish(tmp_dir: str, final_dir: str) -> None:
    """Atomically make a finished `*.tmp` directory visible under its final name."""
    _fsync_dir(tmp_dir)
    if os.path.exists(final_dir):  # same step written again (e.g. resume=false in an old run dir)
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(os.path.dirname(final_dir))


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    with open(os.path.join(ckpt_dir, MANIFEST)) as f:
        return json.load(f)


def problem(ckpt_dir: str) -> Optional[str]:
    """Why `ckpt_dir` is not a complete checkpoint, or None when it is."""
    if not os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        return "no manifest.json (the write did not finish)"
    try:
        manifest = read_manifest(ckpt_dir)
        files, world = manifest["files"], manifest["layout"]["world_size"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest.json ({exc})"
    for rank in range(world):
        if shard_name(rank) not in files:
            return f"manifest.json does not list {shard_name(rank)} of world size {world}"
    for name, want in files.items():
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            return f"shard {name} is missing"
        size = os.path.getsize(path)
        if size != want["bytes"]:
            return f"shard {name} has {size} bytes, manifest.json says {want['bytes']}"
        if file_sha256(path) != want["sha256"]:
            return f"shard {name} fails its sha256 checksum (corrupt)"
    return None


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, dir) of every final-named checkpoint directory under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def find_latest(root: str) -> tuple[Optional[tuple[int, str]], list[str]]:
    """The newest complete checkpoint (or None) and one warning per newer one skipped.

    Each skipped checkpoint is also reported with a CheckpointWarning, naming the
    problem and the checkpoint that is used instead.
    """
    skipped: list[str] = []
    for step, path in reversed(list_checkpoints(root)):
        why = problem(path)
        if why is None:
            for msg in skipped:
                warnings.warn(f"{msg}; resuming from {path} instead", CheckpointWarning, stacklevel=2)
            return (step, path), skipped
        skipped.append(f"skipping checkpoint {path}: {why}")
    for msg in skipped:
        warnings.warn(f"{msg}; no complete checkpoint left, starting from scratch", CheckpointWarning,
                      stacklevel=2)
    return None, skipped


def remove_partial(root: str) -> list[str]:
    """Delete the `step_N.tmp/` directories a failed or killed save left under root (never read:
    only final names count); one CheckpointWarning each. Call before this run saves anything."""
    if not os.path.isdir(root):
        return []
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if _STEP_DIR.match(name.removesuffix(".tmp")) and name.endswith(".tmp") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            warnings.warn(f"removed {path}: an unfinished checkpoint left by an earlier save that failed or was "
                          "killed (it was never used)", CheckpointWarning, stacklevel=2)
    return removed


def prune(root: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all); returns the deleted dirs.

    Called right after a new checkpoint was published and verified, so the newest
    one, which is always kept, is complete.
    """
    if keep_last <= 0:
        return []
    doomed = [path for _, path in list_checkpoints(root)[:-keep_last]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
