"""check_reference: `pref.reference` against the policy's resolved architecture (its config.json read
as megaft.models.hf.load reads a checkpoint's)."""
from __future__ import annotations

import dataclasses
import os

from megaft.config.pref import PrefConfig, needs_reference


def check_reference(cfg: PrefConfig, objective: str, model) -> list[str]:
    """pref.reference against the resolved model config `model`: a checkpoint of the same
    architecture, for an objective that has a reference."""
    if cfg.reference is None:
        return []
    if not needs_reference(objective):
        return [f"pref.reference={cfg.reference}: train.objective={objective} has no reference model; fix: "
                "pref.reference=null"]
    return reference_dir_problems(cfg.reference, "pref.reference", model)


def reference_dir_problems(path: str, key: str, model) -> list[str]:
    """A reference checkpoint `path` (the setting `key`) against the resolved policy config `model`:
    a Hugging Face checkpoint of the same architecture (pref.reference, rl.reference)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return [f"{key}={path} is not a Hugging Face checkpoint directory (no config.json); fix: "
                "point it at one of the same architecture as model.init_from, or null for the starting model"]
    from megaft.models.hf.config import hf_model_config

    try:
        ref = hf_model_config(path, base=model)
    except (OSError, ValueError) as exc:
        return [f"{key}: {exc}"]
    differ = [f.name for f in dataclasses.fields(model) if f.name not in ("init_from", "name", "extra")
              and getattr(ref, f.name) != getattr(model, f.name)]
    if differ:
        return [f"{key}={path} has another architecture than the policy ("
                + ", ".join(f"{k}: {getattr(ref, k)} against {getattr(model, k)}" for k in differ[:4])
                + "); fix: a reference of the policy's architecture (e.g. the SFT checkpoint it starts from)"]
    return []
