"""`QwenVLModel`: Qwen2_5_VLForConditionalGeneration in megaft. The vision tower
(megaft.models.vision.qwen_tower) turns each image into (h / merge) x (w / merge) vectors of
the language model's width; those replace, in order, the embeddings of the image tokens
(<|image_pad|>) of `input_ids`; the language model is a megaft Decoder (a Qwen2 decoder),
tensor parallel over `group`, attending causally (no bidirectional image block, unlike
Gemma 3).

M-RoPE: every token has a temporal, a height and a width position (`mrope_positions`, as
transformers' get_rope_index): text advances all three by one; an image's tokens sit on its
grid, (start, start + row, start + column), and the text after it starts at start + max(rows,
columns). Each rotary frequency pair reads one of the three positions by mrope_section
(t, h, w, in that order), which `Docs.dim_positions` carries to every attention layer.

Parameter names: `visual.*` (transformers' names inside the tower) and `language_model.*` (the
Decoder's); megaft.models.vision.hf maps them to the published checkpoint."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megaft.config.kernels import KernelsConfig
from megaft.models.attention.documents import Docs
from megaft.models.decoder import Decoder, rope_of
from megaft.models.vision.model import ImageTokenMismatch, shard_scatter
from megaft.models.vision.qwen_config import QwenVLConfig
from megaft.models.vision.qwen_tower import QwenVisionTower
from megaft.models.vision.staged import StagedVision
from megaft.parallel.comm import Group, group_rank
from megaft.parallel.tensor.shard import mark_sequence_parallel


def image_runs(is_image: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of image tokens in one row."""
    edges = torch.diff(torch.nn.functional.pad(is_image.long(), (1, 1))).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def mrope_positions(input_ids: torch.Tensor, image_token_id: int, grid_thw: Optional[torch.Tensor],
                    merge: int) -> torch.Tensor:
    """[3, batch, seq] temporal, height and width positions (module docstring); each run of
    image tokens is the next image of `grid_thw` (rows in order), with exactly its tokens."""
    b, s = input_ids.shape
    out = torch.empty(3, b, s, dtype=torch.long)
    grids = iter([] if grid_thw is None else grid_thw.tolist())
    for row in range(b):
        at, pos = 0, 0
        for start, end in image_runs((input_ids[row] == image_token_id).cpu()) + [(s, s)]:
            out[:, row, at:start] = torch.arange(pos, pos + start - at)
            pos += start - at
            if start == s:
                break
            t, h, w = next(grids, (0, 0, 0))
            gh, gw = h // merge, w // merge
            if t * gh * gw != end - start:
                raise ImageTokenMismatch(f"Image features and image tokens do not match: a run of {end - start} "
                                         f"image tokens for an image of {t * gh * gw} (grid {t}x{h}x{w})")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            out[:, row, start:end] = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos
            pos, at = pos + max(gh, gw), end
    return out.to(input_ids.device)


def dim_positions(positions: torch.Tensor, section: tuple) -> torch.Tensor:
    """[batch, seq, head_dim]: rotary dimension j of a token reads positions[axis(j)], the axes
    (t, h, w) taking mrope_section[0], [1], [2] frequency pairs, the same for both halves."""
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    axis = torch.cat([axis, axis]).to(positions.device)
    return positions.permute(1, 2, 0)[..., axis]


class QwenVLModel(StagedVision, nn.Module):
    """The whole multimodal model on every tp rank of `group` (language model tp-sharded, tower
    replicated). Under `sequence_parallel` each rank writes the features of its own sequence
    shard, and the tower's gradients are partial sums over tp (as VisionLanguageModel's). Under
    pp, `language_model` is this rank's stages and only the first stage's rank holds the tower
    (megaft.models.vision.staged)."""

    def __init__(self, cfg: QwenVLConfig, *, group: Group = None, sequence_parallel: bool = False,
                 kernels: Optional[KernelsConfig] = None, language_model: Optional[Decoder] = None):
        super().__init__()
        self.vlm, self.cfg = cfg, cfg.text
        first = getattr(language_model, "is_first", True)  # the tower sits beside the embedding
        self.visual = QwenVisionTower(cfg.vision) if first else None
        self.language_model = language_model or Decoder(cfg.text, group=group, sequence_parallel=sequence_parallel,
                                                        kernels=kernels)
        if self.language_model.sp and first:
            for p in self.visual.parameters():
                mark_sequence_parallel(p)
        self.tower_every_step = False  # ZeRO-3: a micro-batch without images runs the tower on a blank one

    def tower_units(self) -> list[Optional[nn.Module]]:
        """The tower (None on a pipeline rank without it)."""
        return [self.visual]

    def blank_features(self, x: torch.Tensor) -> torch.Tensor:
        """0 (a scalar) computed from the tower's features of one blank merge x merge patch image:
        the tower runs forward and backward (its gradient from it is exactly 0) as on a rank with images."""
        v = self.vlm.vision
        grid = torch.tensor([[1, v.merge, v.merge]], device=x.device)
        blank = torch.zeros(v.merge ** 2, v.patch_dim, device=x.device)
        return self.visual(blank, grid).to(x.dtype).sum() * 0

    def tokens_per_image(self, grid_thw: torch.Tensor) -> torch.Tensor:
        return grid_thw.prod(-1) // self.vlm.vision.merge ** 2

    def embed(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor],
              image_grid_thw: Optional[torch.Tensor]) -> torch.Tensor:
        is_image = input_ids == self.vlm.image_token_id
        x = self.language_model.embed(torch.where(is_image, 0, input_ids))
        n_tokens = int(is_image.sum())
        n_features = 0 if image_grid_thw is None else int(self.tokens_per_image(image_grid_thw).sum())
        if n_tokens != n_features:
            raise ImageTokenMismatch(f"Image features and image tokens do not match: {n_tokens} image tokens, "
                                     f"{n_features} image features")
        if not n_features:
            return x + self.blank_features(x) if self.tower_every_step else x
        features = self.visual(pixel_values, image_grid_thw).to(x.dtype)
        if not self.language_model.sp:
            return x.masked_scatter(is_image.unsqueeze(-1), features)
        return shard_scatter(x, is_image, features, group_rank(self.language_model.group))

    def docs(self, input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor]) -> Docs:
        """One causal sequence per row, each rotary dimension at its M-RoPE position."""
        positions = mrope_positions(input_ids, self.vlm.image_token_id, image_grid_thw, self.vlm.vision.merge)
        return Docs(positions[0], torch.zeros_like(input_ids),
                    dim_positions=dim_positions(positions, self.vlm.mrope_section))

    def blocks(self, input_ids, pixel_values, image_grid_thw) -> torch.Tensor:
        lm = self.language_model
        docs = self.docs(input_ids, image_grid_thw)  # first: a cut image is named before the tower runs
        cache = lm.layers[0].self_attn.cache
        if cache is not None:  # a prompt filling the KV cache (megaft.inference.vision): the decoding steps'
            if input_ids.shape[0] != 1:  # text continues at its last M-RoPE position + 1 (transformers' rope_deltas)
                raise ValueError("decoding with images takes one prompt at a time")
            cache.state.rope_offset = int(docs.position_ids.max()) + 1 - input_ids.shape[1]
        x, docs = self.embed(input_ids, pixel_values, image_grid_thw), lm.prepare_docs(docs)
        for i, layer in enumerate(lm.layers):
            x = layer(x, *rope_of(lm, lm.cfg, i), docs)
        return x

    def forward(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
                image_grid_thw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This tp rank's vocabulary slice of the logits [batch, seq, padded vocab / tp]. Text alone
        is the language model's causal forward (M-RoPE's three positions are then equal)."""
        if image_grid_thw is None and not bool((input_ids == self.vlm.image_token_id).any()):
            return self.language_model(input_ids)
        return self.language_model.head_out(self.blocks(input_ids, pixel_values, image_grid_thw))[
            :, :input_ids.shape[1]]

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
                 image_grid_thw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Summed token loss against `labels` (next tokens, -100 where no target), fp32."""
        if image_grid_thw is None and not self.tower_every_step and \
                not bool((input_ids == self.vlm.image_token_id).any()):
            return self.language_model.loss_sum(input_ids, labels)
        return self.language_model.head_out(self.blocks(input_ids, pixel_values, image_grid_thw), labels)
