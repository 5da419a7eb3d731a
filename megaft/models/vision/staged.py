"""A vision-language model over pipeline stages (parallel.pp > 1 with images).

The language model is then this pp rank's stages of it (a StageModel, built by
megaft.pipeline.vision: its virtual stages' blocks, the full model's parameter names); the
tower and projector sit on the first pipeline stage only, beside the embedding, so only pp
rank 0 holds them. Each micro-batch's images travel beside its ids as `ImageInputs`, in the
slot the runtime gives each micro-batch's packed documents (PipelineRuntime.train_step's
`docs`): every stage rebuilds the attention layout from the ids (Gemma 3: the image blocks
seen both ways; Qwen2.5-VL: the M-RoPE positions from the images' grids), the first stage also
runs the tower and writes the features into the embeddings, and what flows between the stages
is the residual stream, as for text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megaft.models.decoder import rope_of


@dataclass
class ImageInputs:
    """One micro-batch's ids and images: `pixels` (Gemma 3 [images, 3, H, W]; Qwen2.5-VL its patches),
    None without images; `extra` the model's further image arguments (Qwen2.5-VL: `(grids,)`)."""

    input_ids: torch.Tensor
    pixels: Optional[torch.Tensor]
    extra: tuple = ()


class StagedVision:
    """What both vision-language models add for the pipeline (they define `docs` and `embed`)."""

    def stage_forward(self, stage: int, x: torch.Tensor, labels: Optional[torch.Tensor], images: ImageInputs,
                      seq_len: Optional[int] = None, router_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Virtual stage `stage` on `x` (the ids on stage 0, the previous stage's activations
        otherwise), as StageModel.forward: the last stage returns the summed token loss against
        `labels`, or without labels this tp rank's vocabulary slice of the logits."""
        lm = self.language_model
        ids = images.input_ids.to(lm.rope_cos.device)
        lm.start_router_log(seq_len or ids.shape[1], None, router_valid)
        docs = self.docs(ids, *images.extra)  # before the tower: a cut image is named first
        if stage == 0:
            pixels = None if images.pixels is None else images.pixels.to(ids.device)
            x = self.embed(ids, pixels, *(None if e is None else e.to(ids.device) for e in images.extra))
        docs = lm.prepare_docs(docs)
        for i in lm.stage_ranges[stage]:
            x = lm.layers[str(i)](x, *rope_of(lm, lm.cfg, i), docs)
        return x if stage != lm.last_stage else lm.head_out(x, labels)

    def zero3_units(self) -> list[nn.Module]:
        """The layers in the order they run (megaft.optim.zero3): the embedding, the tower (and
        projector), the blocks, the head; under pp this rank's of them (a StageModel keys its blocks)."""
        lm = self.language_model
        blocks = lm.layers.values() if isinstance(lm.layers, nn.ModuleDict) else lm.layers
        head = [getattr(lm, name) for name in ("norm", "lm_head") if hasattr(lm, name)]
        embed = [lm.embed_tokens] if hasattr(lm, "embed_tokens") else []
        return [*embed, *(m for m in self.tower_units() if m is not None), *blocks, *head]

    def norm_params(self) -> list[nn.Parameter]:
        """The parameters the grad norm counts: all trainable ones but the last stage's tied copy."""
        lm = self.language_model
        skip = lm.embed_tokens.weight if getattr(lm, "tied_copy", False) else None
        return [p for p in self.parameters() if p.requires_grad and p is not skip]
