"""Guards of a run: give up on a diverged run, and refuse a checkpoint of another model.

- `BadStepGuard` (`train.max_bad_steps`): a step whose loss or global grad norm is not
  finite is bad (an fp16 overflow that the loss scaler skipped, or NaN weights after an
  fp32/bf16 blow-up). The loss is all-reduced and the grad norm global, so every rank
  counts the same streak and raises at the same step, without a collective. No checkpoint
  is written after a step that may have spoiled the weights (a non-finite loss, or a
  non-finite grad norm that was not skipped by the fp16 loss scaler), so the newest
  checkpoint stays the last good one; an fp16 step the scaler skipped left them intact.
- `model_signature(cfg.model)`: the fields that fix the model's shape and architecture,
  recorded in every checkpoint's manifest and compared on resume (megaft.checkpoint.state.check_model
  names every field that differs): only layout changes (tp, pp, dp, ZeRO) reshard.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from megaft.checkpoint import list_checkpoints

# ModelConfig fields that change no tensor and no computation of the trained weights.
NOT_ARCHITECTURE = frozenset({"name", "init_from", "init_std", "dropout", "extra", "max_seq_len"})


class BadStepsError(RuntimeError):
    """train.max_bad_steps consecutive steps had a non-finite loss or grad norm."""


def model_signature(model_cfg: Any) -> dict[str, Any]:
    """The architecture fields of a ModelConfig as plain JSON values (resolved: vocab_size is set)."""
    out = {}
    for f in dataclasses.fields(model_cfg):
        if f.name not in NOT_ARCHITECTURE:
            value = getattr(model_cfg, f.name)
            out[f.name] = dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value
    return out


class BadStepGuard:
    """Counts consecutive non-finite steps and raises BadStepsError past `max_bad` (0 = never)."""

    def __init__(self, max_bad: int, checkpoint_dir: str):
        self.max_bad, self.checkpoint_dir = max_bad, checkpoint_dir
        self.streak, self.first_bad = 0, 0
        self.suspect = False  # the weights may be non-finite since the last step

    @staticmethod
    def is_bad(record: dict[str, float]) -> bool:
        return not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]))

    def observe(self, step: int, record: dict[str, float]) -> None:
        """After step `step` (1-based) with its train record; raises once the streak reaches max_bad."""
        if not self.is_bad(record):
            self.streak, self.suspect = 0, False
            return
        skipped = "loss_scale" in record and math.isfinite(record["loss"])  # fp16: the update was not applied
        self.suspect = self.suspect or not skipped
        self.streak += 1
        self.first_bad = self.first_bad if self.streak > 1 else step
        if self.max_bad and self.streak >= self.max_bad:
            raise BadStepsError(self._message(step, record))

    def _message(self, step: int, record: dict[str, float]) -> str:
        detail = f"loss={record['loss']:g} grad_norm={record['grad_norm']:g}"
        if "loss_scale" in record:
            detail += f" loss_scale={record['loss_scale']:g} skipped_steps={record.get('skipped_steps')}"
        found = list_checkpoints(self.checkpoint_dir)
        kept = (f"the last good checkpoint is {found[-1][1]} (none was written after a non-finite step)" if found
                else "there is no checkpoint to keep (train.save_every=0 or none written yet)")
        return (f"training diverged: {self.streak} consecutive steps ({self.first_bad}..{step}) had a non-finite "
                f"loss or grad norm (last: {detail}), train.max_bad_steps={self.max_bad}; {kept}; fix: lower "
                "optim.lr, raise optim.warmup_steps or lower optim.clip_grad, use precision=bf16 or fp32, and "
                "resume from the checkpoint (or raise train.max_bad_steps, 0 = never abort)")

    def may_save(self) -> bool:
        """No checkpoint once a bad step may have made the weights non-finite (until a good step)."""
        return not self.suspect

