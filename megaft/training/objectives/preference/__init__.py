"""train.objective = dpo | robust | ipo | simpo | orpo: preference pairs, each a chosen and a
rejected answer to one prompt, as TRL's trainers define them (megaft.pref.losses).

`data`: the pairs from the prepared store as rows, packed or not, split over the layout;
`step`: each micro-batch's rows through the model once, the objective over their log-probs,
with the reference model's log-probs precomputed, stored or scored online.
"""
from __future__ import annotations

from megaft.training.model import build_model
from megaft.training.objectives.preference.data import build_pref_data as build_data
from megaft.training.objectives.preference.step import PipelinePreferenceStep, PreferenceStep
from megaft.training.protocols import RunParts, StepPart

__all__ = ["build_data", "build_step"]


def build_step(parts: RunParts) -> StepPart:
    """The preference step at this layout (pipelined when pp > 1); the reference model, when the
    objective has one, is built as the policy is (megaft.training.model.build_model)."""
    step = PipelinePreferenceStep if parts.grid.pp_size > 1 else PreferenceStep
    return step(parts, build_model)
