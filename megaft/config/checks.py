"""The lower-bound check that the config dataclasses' check_* functions share (stdlib only)."""
from __future__ import annotations

from typing import Any


def at_least(cfg: Any, key: str, floor: int, note: str = "", fix: str = "") -> list[str]:
    """[problem] when the field `key` names ("train.save_every" -> cfg.save_every) is below `floor`, else []:
    "<key>=<value> must be >= <floor>[ <note>][; fix: <fix>]"."""
    value = getattr(cfg, key.rpartition(".")[2])
    if value >= floor:
        return []
    return [f"{key}={value} must be >= {floor}" + (f" {note}" if note else "") + (f"; fix: {fix}" if fix else "")]
