"""Adapter-only (LoRA) checkpoints: the base they adapt must be this run's base.

A LoRA run's FlatParams hold the adapters only (the frozen base is not trainable), so
its checkpoints hold the adapters, their AdamW state and the step; the manifest's
"lora" entry (megaft.peft.base.lora_record) names the base. `check_lora_base` refuses
a resume against another base, or across LoRA and full fine-tuning.
"""
from __future__ import annotations

from typing import Any, Optional


class BaseMismatchError(ValueError):
    """The adapter checkpoint was trained on another base model (or is not an adapter checkpoint)."""


def check_lora_base(manifest: dict[str, Any], expect: Optional[dict[str, Any]], path: str) -> None:
    """Raise BaseMismatchError when the manifest's "lora" record and this run's (`expect`: {}
    for a run without LoRA, None to skip the check) disagree on the base or the adapters."""
    if expect is None:
        return
    saved = manifest.get("lora") or {}
    if not saved and not expect:
        return
    if not saved or not expect:
        what = ("a full fine-tune's, this run trains LoRA adapters" if not saved else
                "LoRA adapters only, this run is a full fine-tune")
        raise BaseMismatchError(f"checkpoint {path} holds {what}; fix: resume with the lora.* settings it was "
                                "saved with, or start in a new run directory (hydra.run.dir)")
    if saved.get("base_fingerprint") != expect.get("base_fingerprint"):
        raise BaseMismatchError(
            f"checkpoint {path} holds LoRA adapters of another base model: saved on {saved.get('base')!r} "
            f"(fingerprint {str(saved.get('base_fingerprint'))[:12]}), this run's base is {expect.get('base')!r} "
            f"(fingerprint {str(expect.get('base_fingerprint'))[:12]}); fix: set model.init_from to the base the "
            "adapters were trained on, or start in a new run directory (hydra.run.dir)")
    diff = [f"lora.{k}: checkpoint {saved.get(k)!r}, this run {expect.get(k)!r}" for k in ("rank", "targets")
            if saved.get(k) != expect.get(k)]
    if diff:
        raise BaseMismatchError(f"checkpoint {path} holds other adapters: {'; '.join(diff)}; fix: resume with the "
                                "checkpoint's lora settings, or start in a new run directory (hydra.run.dir)")
