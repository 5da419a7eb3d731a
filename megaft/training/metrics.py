"""Run-directory outputs: metrics.jsonl (one JSON object per line) and TensorBoard event
files (run_dir/tensorboard, the same scalars); summary.json is megaft.training.summary's."""
from __future__ import annotations

import json
import os
from typing import Any, Optional


class MetricsLog:
    """Appends train/eval lines to run_dir/metrics.jsonl; only the writer rank writes.
    With `tensorboard`, every numeric field of a line is also a scalar (tag = its key)
    at the line's step in run_dir/tensorboard. The event writer opens at the first line
    and purges events at or after that line's step: a resumed run's files then continue
    from its checkpoint, as metrics.jsonl does (megaft.checkpoint.trim_metrics). A `tracker`
    (megaft.training.wandb_log.WandbLog under logger=wandb) gets every line too, and is
    closed with the log."""

    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool = False, tracker: Optional[Any] = None):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.enabled = enabled
        self._file: Optional[Any] = open(self.path, "a", buffering=1) if enabled else None
        self._tb: Optional[Any] = None
        self._tb_dir = os.path.join(run_dir, "tensorboard") if enabled and tensorboard else None
        self.tracker = tracker if enabled else None

    def write(self, **record: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self._tb_dir is not None and self._tb is None and "step" in record:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self._tb_dir, purge_step=record["step"])
        if self._tb is not None and "step" in record:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record["step"])
        if self.tracker is not None:
            self.tracker.write(record)

    def text(self, step: int, tag: str, text: str) -> None:
        """A text entry at `step` in TensorBoard (samples while training, megaft.training.samples);
        nothing without TensorBoard (or W&B). The event writer opens here if no line opened it yet."""
        if self._tb_dir is not None and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self._tb_dir, purge_step=step)
        if self._tb is not None:
            self._tb.add_text(tag, text, step)
        if self.tracker is not None:  # W&B gets the samples too (logger=wandb)
            self.tracker.text(step, tag, text)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._tb_dir = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
