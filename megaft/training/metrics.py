"""Run-directory outputs: metrics.jsonl (one JSON object per line) and summary.json."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from megaft.fileio import write_json_atomic


class MetricsLog:
    """Appends train/eval lines to run_dir/metrics.jsonl; only the writer rank writes."""

    def __init__(self, run_dir: str, *, enabled: bool):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.enabled = enabled
        self._file: Optional[Any] = open(self.path, "a", buffering=1) if enabled else None

    def write(self, **record: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_summary(run_dir: str, summary: dict[str, Any]) -> None:
    """summary.json, written atomically so readers never see half of it."""
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary)
