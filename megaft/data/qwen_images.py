"""Images -> flattened patches and their grid, as Qwen2.5-VL's image processor makes them
(transformers' Qwen2VLImageProcessor, its Pillow backend): the image read as
megaft.data.images reads it (EXIF orientation, RGB), resized with Pillow (bicubic unless
preprocessor_config.json says otherwise) to `smart_resize`'s size (both sides multiples of
patch_size * merge_size, the area within [min_pixels, max_pixels], the aspect kept as close as
it can), rescaled in float64 then cast to float32, normalized per channel in float32, then cut
into patches: merge x merge blocks row-major, patches row-major inside each, each patch
repeated temporal_patch_size times and flattened (channels, time, row, column).

Each image becomes, in the text, its <|image_pad|> repeated (h / merge) x (w / merge) times
(Qwen2_5_VLProcessor's replacement of the <|image_pad|> the chat template writes between
<|vision_start|> and <|vision_end|>)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image

from megaft.data.errors import DataError
from megaft.data.images import PREPROCESSOR, PROCESSOR, read_json, rgb

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: (height, width) multiples of `factor`, area within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise DataError(f"an image of {width}x{height} pixels: the aspect ratio must be under 200 (Qwen2.5-VL's "
                        "processor refuses it too); fix: crop it")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenImageProcessing:
    """What turns one image into patches and into tokens (Qwen2.5-VL's processor)."""
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    boi: str = "<|vision_start|>"
    eoi: str = "<|vision_end|>"
    image_token: str = "<|image_pad|>"

    @property
    def marker(self) -> str:
        """What the chat template writes for an image part, which the image's tokens replace."""
        return self.image_token

    def sequence(self, n_tokens: int) -> str:
        return self.image_token * n_tokens

    @property
    def empty(self) -> np.ndarray:
        return np.zeros((0, 3 * self.temporal_patch_size * self.patch_size ** 2), np.float32)

    def image(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int], int]:
        """(patches [h * w, patch_dim] float32, grid (1, h, w) in patches, its tokens in the text)."""
        image = rgb(image)
        height, width = smart_resize(image.height, image.width, self.patch_size * self.merge_size,
                                     self.min_pixels, self.max_pixels)
        resized = image.resize((width, height), resample=self.resample)
        scaled = (np.asarray(resized).astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = ((scaled - np.asarray(self.mean, dtype=np.float32)) / np.asarray(self.std, dtype=np.float32))
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        blocks = pixels.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        return (np.ascontiguousarray(patches.reshape(gh * gw, 3 * t * p * p), dtype=np.float32), (1, gh, gw),
                gh * gw // (m * m))

    @classmethod
    def from_checkpoint(cls, path: str, vision: dict) -> "QwenImageProcessing":
        """From preprocessor_config.json (transformers 5: processor_config.json's image_processor),
        checked against config.json's `vision` (vision_config) sizes."""
        file = os.path.join(path, PREPROCESSOR)
        if os.path.isfile(file):
            pre = read_json(file)
        else:
            file = os.path.join(path, PROCESSOR)
            pre = (read_json(file) if os.path.isfile(file) else {}).get("image_processor") or {}
        for key, want in (("do_resize", True), ("do_rescale", True), ("do_normalize", True),
                          ("do_convert_rgb", True)):
            if pre.get(key, want) is not want:
                raise DataError(f"{file}: {key}={pre[key]} is not supported; fix: {key}={str(want).lower()} "
                                "(Qwen2.5-VL's processor)")
        size = pre.get("size") or {}
        got = cls(min_pixels=int(pre.get("min_pixels", size.get("shortest_edge", cls.min_pixels))),
                  max_pixels=int(pre.get("max_pixels", size.get("longest_edge", cls.max_pixels))),
                  patch_size=int(pre.get("patch_size", cls.patch_size)),
                  temporal_patch_size=int(pre.get("temporal_patch_size", cls.temporal_patch_size)),
                  merge_size=int(pre.get("merge_size", cls.merge_size)),
                  mean=tuple(pre.get("image_mean", cls.mean)), std=tuple(pre.get("image_std", cls.std)),
                  rescale_factor=float(pre.get("rescale_factor", cls.rescale_factor)),
                  resample=int(pre.get("resample", cls.resample)))
        model = {"patch_size": vision.get("patch_size", 14), "merge_size": vision.get("spatial_merge_size", 2),
                 "temporal_patch_size": vision.get("temporal_patch_size", 2)}
        differ = {k: (getattr(got, k), v) for k, v in model.items() if getattr(got, k) != v}
        if differ:
            raise DataError(f"{file}: {', '.join(f'{k}={a}' for k, (a, _) in differ.items())} but config.json's "
                            f"vision_config has {', '.join(f'{k}={b}' for k, (_, b) in differ.items())}; fix: make "
                            "them equal (the tower cuts the processor's patches)")
        return got
