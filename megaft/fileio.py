"""Small file helpers shared by the run directory, checkpoints and exports."""
from __future__ import annotations

import json
import os
from typing import Any


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to a temporary name, fsync, then rename: readers see the old file or
    the whole new one, never half (summary.json, checkpoint manifests)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
