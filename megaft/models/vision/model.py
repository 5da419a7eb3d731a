"""`VisionLanguageModel`: Gemma3ForConditionalGeneration in megaft. The SigLIP tower
(megaft.models.vision.siglip) and the projector turn each image into mm_tokens_per_image
vectors of the language model's width; those replace, in order, the embeddings of the
image tokens of `input_ids` (after Gemma's sqrt(dim) scaling, which they skip, as in
transformers); the language model is a megaft Decoder, tensor parallel over `group`.

Attention is causal except among the tokens of one image, which see each other both ways
(transformers' token_type_ids mask; here derived from the image token ids, which is the
same thing: the processor marks exactly those positions), and the sliding window of the
local layers still applies (megaft.models.attention.documents, `Docs.image_blocks`).
Parameter names: `vision_tower.*`, `multi_modal_projector.*` (transformers' names inside
them) and `language_model.*` (the Decoder's); megaft.models.vision.hf maps them to the
published checkpoint."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megaft.config.kernels import KernelsConfig
from megaft.models.attention.documents import Docs
from megaft.models.decoder import Decoder, rope_of
from megaft.models.vision.config import VisionLanguageConfig
from megaft.models.vision.projector import Gemma3Projector
from megaft.models.vision.siglip import SiglipTower
from megaft.models.vision.staged import StagedVision
from megaft.parallel.comm import Group, group_rank
from megaft.parallel.tensor.shard import mark_sequence_parallel


def image_blocks(is_image: torch.Tensor) -> torch.Tensor:
    """[batch, seq] index of the image each token belongs to (a run of image tokens), -1 for
    text (transformers' get_block_sequence_ids_for_mask)."""
    start = is_image & ~F.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, start.long().cumsum(1) - 1, -1)


def shard_scatter(x: torch.Tensor, is_image: torch.Tensor, features: torch.Tensor, rank: int) -> torch.Tensor:
    """masked_scatter of `features` [image tokens, dim] (row-major order over [batch, seq]) into
    `x`, this tp rank's sequence shard [batch, seq / tp, dim] of the right-padded rows."""
    local = x.shape[1]
    is_image = F.pad(is_image, (0, local * (rank + 1) - is_image.shape[1])) if \
        is_image.shape[1] < local * (rank + 1) else is_image
    index = (is_image.flatten().cumsum(0) - 1).view(is_image.shape)[:, rank * local:(rank + 1) * local]
    mine = is_image[:, rank * local:(rank + 1) * local]
    return torch.where(mine.unsqueeze(-1), features[index.clamp(min=0)], x)


class ImageTokenMismatch(ValueError):
    """A micro-batch whose image tokens do not match its images' features (a cut image)."""


class VisionLanguageModel(StagedVision, nn.Module):
    """The whole multimodal model on every tp rank of `group` (language model tp-sharded,
    tower and projector replicated). Under `sequence_parallel` each rank writes the features
    of its own sequence shard (`shard_scatter`); the tower's and projector's gradients are
    then partial and marked to be summed over tp like the norms' (megaft.parallel.tensor.grads).
    Under ZeRO-3 every micro-batch runs the tower (`tower_every_step`). Under pp,
    `language_model` is this rank's stages (megaft.pipeline.vision) and only the first stage's
    rank holds the tower and projector (megaft.models.vision.staged). No context parallel yet:
    validation refuses it with images (docs/vision.md)."""

    def __init__(self, cfg: VisionLanguageConfig, *, group: Group = None, sequence_parallel: bool = False,
                 kernels: Optional[KernelsConfig] = None, language_model: Optional[Decoder] = None):
        super().__init__()
        self.vlm, self.cfg = cfg, cfg.text  # `cfg`: the language model's, as Decoder's (checkpoint code reads it)
        first = getattr(language_model, "is_first", True)  # the tower sits beside the embedding
        self.vision_tower = SiglipTower(cfg.vision) if first else None
        self.multi_modal_projector = Gemma3Projector(cfg) if first else None
        self.language_model = language_model or Decoder(cfg.text, group=group, sequence_parallel=sequence_parallel,
                                                        kernels=kernels)
        if self.language_model.sp and first:  # each rank's features feed only its sequence shard: partial grads,
            for p in [*self.vision_tower.parameters(), *self.multi_modal_projector.parameters()]:  # summed over tp
                mark_sequence_parallel(p)
        # ZeRO-3 (set by megaft.training.objectives.images): a micro-batch without images still runs the
        # tower, on one blank image whose features add 0, so every dp rank issues the same parameter gathers
        self.tower_every_step = False

    def tower_units(self) -> list[Optional[nn.Module]]:
        """The tower's modules in the order they run (None on a pipeline rank without them)."""
        return [self.vision_tower, self.multi_modal_projector]

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, size, size] -> [images, mm_tokens_per_image, text dim]."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def embed(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor]) -> torch.Tensor:
        """The language model's input: token embeddings, image features at the image tokens."""
        is_image = input_ids == self.vlm.image_token_id
        # the placeholder may lie past the vocabulary (transformers then looks up id 0): its embedding
        # is replaced either way, so its row gets no gradient on both sides
        x = self.language_model.embed(torch.where(is_image, 0, input_ids))
        n_tokens = int(is_image.sum())
        n_images = 0 if pixel_values is None else pixel_values.shape[0]
        if n_tokens != n_images * self.vlm.mm_tokens_per_image:
            raise ImageTokenMismatch(f"Image features and image tokens do not match: {n_tokens} image tokens, "
                                     f"{n_images} images of {self.vlm.mm_tokens_per_image} tokens")
        if not n_images:
            return x + self.blank_features(x) if self.tower_every_step else x
        features = self.image_features(pixel_values).to(x.dtype)
        if not self.language_model.sp:
            return x.masked_scatter(is_image.unsqueeze(-1), features)  # transformers' op
        return shard_scatter(x, is_image, features.flatten(0, 1), group_rank(self.language_model.group))

    def blank_features(self, x: torch.Tensor) -> torch.Tensor:
        """0 (a scalar) computed from the features of one blank image: the tower and projector run
        forward and backward (their gradient from it is exactly 0) as on a rank with images."""
        size = self.vlm.vision.image_size
        blank = torch.zeros(1, self.vlm.vision.channels, size, size, device=x.device)  # the tower casts it
        return self.image_features(blank).to(x.dtype).sum() * 0

    def docs(self, input_ids: torch.Tensor) -> Docs:
        """One causal sequence per row with the images seen both ways."""
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
        return Docs(positions, torch.zeros_like(input_ids),
                    image_blocks=image_blocks(input_ids == self.vlm.image_token_id))

    def blocks(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor]) -> torch.Tensor:
        lm = self.language_model
        x, docs = self.embed(input_ids, pixel_values), lm.prepare_docs(self.docs(input_ids))
        for i, layer in enumerate(lm.layers):
            x = layer(x, *rope_of(lm, lm.cfg, i), docs)
        return x

    def forward(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This tp rank's vocabulary slice of the logits [batch, seq, padded vocab / tp]. Text alone
        (no pixels, no image token) is the language model's causal forward: the same numbers, and
        the path a KV-cached decoding step takes (megaft.inference.vision)."""
        if pixel_values is None and not bool((input_ids == self.vlm.image_token_id).any()):
            return self.language_model(input_ids)
        return self.language_model.head_out(self.blocks(input_ids, pixel_values))[:, :input_ids.shape[1]]

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 pixel_values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Summed token loss against `labels` (next tokens, -100 where no target), fp32."""
        return self.language_model.head_out(self.blocks(input_ids, pixel_values), labels)
