"""Small file helpers shared by the run directory, checkpoints and exports."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes, read in chunks (checkpoint shards, prepared stores, models)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to a temporary name, fsync, then rename: readers see the old file or
    the whole new one, never half (summary.json, checkpoint manifests)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> Optional[Any]:
    """The JSON in `path`, or None when it is missing or not (yet) whole."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_jsonl(path: str) -> list[Any]:
    """The records of a JSON-lines file (metrics.jsonl), skipping a line being written
    right now; [] when the file is missing."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return rows
