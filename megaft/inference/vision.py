"""Decoding from a vision-language model (megaft.models.vision) with the images of the prompt.

Without a KV cache yet: every step runs the whole sequence, images included, through the
model, so the image tokens' bidirectional mask is the training forward's (the cache's
attention is causal only). One prompt at a time (its images belong to it); greedy or
sampled as megaft.inference.generate chooses, collective over tp."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megaft.inference.generate import GREEDY, Eos, OnToken, Sampling, _decode, choose, draw_generator


@torch.no_grad()
def generate_with_images(model, prompt: list[int], pixel_values: Optional[torch.Tensor], *, max_new_tokens: int,
                         eos_id: Eos, device: torch.device, sampling: Sampling = GREEDY, step: int = 0,
                         on_token: Optional[OnToken] = None) -> list[int]:
    """Continue `prompt` (its image tokens already expanded, megaft.data.image_chat) given its
    images' `pixel_values` [images, 3, H, W]; returns the new ids (eos excluded)."""
    lm = model.language_model
    generator = draw_generator(sampling, step, device)
    pixels = None if pixel_values is None else pixel_values.to(device)
    was_training = model.training
    model.eval()
    try:
        (out,) = _decode([prompt], max_new_tokens=max_new_tokens, eos_id=eos_id, device=device,
                         max_len=lm.cfg.max_seq_len, cache=lambda capacity: contextlib.nullcontext(),
                         next_tokens=lambda ids: choose(lm, model(ids, pixels)[:, -1], sampling, generator),
                         on_token=on_token)
        return out
    finally:
        model.train(was_training)
