"""Decoding from a vision-language model (megaft.models.vision) with the images of the prompt.

With the KV cache (default) the prompt runs once through the training forward, images and
their bidirectional mask included, filling every layer's cache as it attends
(megaft.models.attention.gqa); each new token then runs alone, a text token attending
causally to everything before it. `cache=False` reruns the whole sequence every step (the
reference the cache is tested against). One prompt at a time (its images belong to it);
greedy or sampled as megaft.inference.generate chooses, collective over tp."""
from __future__ import annotations

from typing import Optional

import torch

from megaft.inference.generate import GREEDY, Eos, OnToken, Sampling, _cache_of, _decode, choose, draw_generator


@torch.no_grad()
def generate_with_images(model, prompt: list[int], pixel_values: Optional[torch.Tensor], *, max_new_tokens: int,
                         eos_id: Eos, device: torch.device, sampling: Sampling = GREEDY, step: int = 0,
                         on_token: Optional[OnToken] = None, cache: bool = True) -> list[int]:
    """Continue `prompt` (its image tokens already expanded, megaft.data.image_chat) given its
    images' `pixel_values` [images, 3, H, W] (Gemma 3), or (patches, grids) (Qwen2.5-VL, whose
    prefill sets the cache's M-RoPE offset); returns the new ids (eos excluded)."""
    lm = model.language_model
    generator = draw_generator(sampling, step, device)
    grids = None
    if isinstance(pixel_values, tuple):
        pixel_values, grids = pixel_values
    pixels = None if pixel_values is None else pixel_values.to(device)
    extra = () if grids is None else (grids,)
    was_training = model.training
    model.eval()
    prefilled = [False]

    def next_tokens(ids: torch.Tensor) -> torch.Tensor:
        # with the cache, `ids` are the new tokens after the first step: text, no images
        first = not (cache and prefilled[0])
        prefilled[0] = True
        return choose(lm, model(ids, *((pixels, *extra) if first else (None,) * (1 + len(extra))))[:, -1],
                      sampling, generator)

    try:
        (out,) = _decode([prompt], max_new_tokens=max_new_tokens, eos_id=eos_id, device=device,
                         max_len=lm.cfg.max_seq_len, cache=_cache_of(model, cache), next_tokens=next_tokens,
                         on_token=on_token)
        return out
    finally:
        model.train(was_training)
