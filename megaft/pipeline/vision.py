"""A vision-language model (megaft.models.vision) over pipeline stages: the language model
built as this pp rank's `StageModel`, and the face the runtime calls (`VisionStages`).
megaft.models.vision.staged says how the images reach the stages."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megaft.models.vision.staged import ImageInputs
from megaft.pipeline.stage import StageModel


def stage_language_model(text_cfg, *, pp: int, pp_rank: int, vpp: int = 1, pp_layers=None, group=None,
                         sequence_parallel: bool = False, kernels=None) -> StageModel:
    """This pp rank's stages of the language model (`text_cfg`: the vision-language config's `text`);
    the model is built with it as `language_model=` and holds the tower only on the first stage."""
    return StageModel(text_cfg, pp=pp, pp_rank=pp_rank, vpp=vpp, pp_layers=pp_layers, group=group,
                      sequence_parallel=sequence_parallel, kernels=kernels)


class VisionStages:
    """What PipelineRuntime and PipelineStep call for a vision-language model: `(stage, x, labels,
    images, seq_len=, router_valid=)` runs one of its stages (`StagedVision.stage_forward`, the
    images in the runtime's per-micro-batch `docs` slot); everything else (`stages`, `last_stage`,
    `activation_shape`, `tied_weight`, `cfg`, ...) is its language model's, a StageModel's."""

    def __init__(self, model: nn.Module):
        self.vlm = model

    def __call__(self, stage: int, x: torch.Tensor, labels: Optional[torch.Tensor] = None,
                 images: Optional[ImageInputs] = None, seq_len: Optional[int] = None, *,
                 router_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        if images is None:
            raise ValueError("a vision-language pipeline stage needs its micro-batch's ImageInputs")
        return self.vlm.stage_forward(stage, x, labels, images, seq_len, router_valid)

    def __getattr__(self, name: str):
        return getattr(self.vlm.language_model, name)
