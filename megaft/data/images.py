"""Images -> pixel values, as the checkpoint's own image processor makes them.

Gemma 3 (transformers' Gemma3ImageProcessor, its Pillow backend; pan-and-scan off, the
published default): a file read as transformers' load_image reads it (EXIF orientation,
RGB), an image in memory with its alpha composited onto white (the processor's
convert_to_rgb); resized to the
processor's size with Pillow (bilinear unless preprocessor_config.json says otherwise),
scaled by rescale_factor in float64 then cast to float32, normalized per channel by
image_mean / image_std in float32, channels first. `tests/data/test_images.py` checks the
values bit for bit against transformers on RGB, RGBA, palette and grayscale images.

`ImageProcessing.from_checkpoint` reads preprocessor_config.json (transformers 5: the
`image_processor` of processor_config.json), the image tokens
(tokenizer_config.json's boi/eoi/image tokens, Gemma 3's names by default) and the tokens
per image (config.json's mm_tokens_per_image)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from megaft.data.errors import DataError

PREPROCESSOR, PROCESSOR = "preprocessor_config.json", "processor_config.json"
# Gemma 3's tokens (its tokenizer_config.json: boi_token, eoi_token, image_token)
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


@dataclass(frozen=True)
class ImageProcessing:
    """What turns one image into pixels and into tokens (Gemma 3's processor)."""
    height: int = 896
    width: int = 896
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BILINEAR  # PIL's code, as preprocessor_config.json writes it
    tokens_per_image: int = 256  # mm_tokens_per_image
    boi: str = GEMMA3_TOKENS["boi_token"]
    eoi: str = GEMMA3_TOKENS["eoi_token"]
    image_token: str = GEMMA3_TOKENS["image_token"]

    @property
    def image_sequence(self) -> str:
        """What each image's <start_of_image> becomes in the text (Gemma3Processor's full_image_sequence)."""
        return f"\n\n{self.boi}{self.image_token * self.tokens_per_image}{self.eoi}\n\n"

    @property
    def marker(self) -> str:
        """What the chat template writes for an image part, which the image's sequence replaces."""
        return self.boi

    def sequence(self, n_tokens: int) -> str:
        return self.image_sequence

    @property
    def empty(self) -> np.ndarray:
        return np.zeros((0, 3, self.height, self.width), np.float32)

    def image(self, image: Image.Image) -> tuple[np.ndarray, None, int]:
        """(pixels [3, height, width], no grid, its image tokens in the text)."""
        return pixel_values(image, self), None, self.tokens_per_image

    @classmethod
    def from_checkpoint(cls, path: str) -> "ImageProcessing":
        config = read_json(os.path.join(path, "config.json"))
        processor = read_json(os.path.join(path, PROCESSOR)) if os.path.isfile(os.path.join(path, PROCESSOR)) else {}
        file = os.path.join(path, PREPROCESSOR)  # transformers 4 and the published checkpoints
        if os.path.isfile(file):
            pre = read_json(file)
        else:  # transformers 5 nests it in processor_config.json
            file, pre = os.path.join(path, PROCESSOR), processor.get("image_processor") or {}
        tokens_per_image = int(config.get("mm_tokens_per_image", cls.tokens_per_image))
        if processor.get("image_seq_length", tokens_per_image) != tokens_per_image:
            raise DataError(f"{os.path.join(path, PROCESSOR)}: image_seq_length={processor['image_seq_length']} but "
                            f"config.json has mm_tokens_per_image={tokens_per_image}; fix: make them equal (the model "
                            "replaces exactly mm_tokens_per_image tokens per image)")
        if pre.get("do_pan_and_scan"):
            raise DataError(f"{file}: do_pan_and_scan=true is not supported yet; fix: "
                            "set it to false (the published Gemma 3 default)")
        for key, want in (("do_resize", True), ("do_rescale", True), ("do_normalize", True),
                          ("do_convert_rgb", True)):
            if pre.get(key, want) is not want:
                raise DataError(f"{file}: {key}={pre[key]} is not supported; fix: "
                                f"{key}={str(want).lower()} (Gemma 3's processor)")
        size = pre.get("size", {"height": cls.height, "width": cls.width})
        tokens = {**GEMMA3_TOKENS, **_named_tokens(path)}
        return cls(height=int(size["height"]), width=int(size["width"]),
                   mean=tuple(pre.get("image_mean", cls.mean)), std=tuple(pre.get("image_std", cls.std)),
                   rescale_factor=float(pre.get("rescale_factor", cls.rescale_factor)),
                   resample=int(pre.get("resample", cls.resample)),
                   tokens_per_image=tokens_per_image,
                   boi=tokens["boi_token"], eoi=tokens["eoi_token"], image_token=tokens["image_token"])


def read_json(file: str) -> dict:
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{file}: cannot read it ({e})") from None


def _named_tokens(path: str) -> dict:
    """boi/eoi/image tokens named in tokenizer_config.json (transformers 5 writes them in
    extra_special_tokens, 4 at the top)."""
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    config = read_json(file)
    named = {**config, **(config.get("extra_special_tokens") or {})} if isinstance(
        config.get("extra_special_tokens"), dict) else config
    return {k: v for k, v in named.items() if k in GEMMA3_TOKENS and isinstance(v, str)}


def load_image(path: str) -> Image.Image:
    """The image file at `path` read with Pillow as transformers reads a path (RGB); a DataError
    naming the file when it cannot be."""
    try:
        with Image.open(path) as image:
            # transformers' load_image: the EXIF orientation applied, then RGB (an alpha channel dropped,
            # not composited: what the processor does with a path, unlike with an image in memory)
            return ImageOps.exif_transpose(image).convert("RGB")
    except FileNotFoundError:
        raise DataError(f"image {path} not found; fix: image paths are relative to the data file's folder") from None
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"image {path} cannot be read by Pillow ({e}); fix: a PNG, JPEG, WebP, ... file") from None


def rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def pixel_values(image: Image.Image, proc: ImageProcessing) -> np.ndarray:
    """[3, height, width] float32 pixels of `image` (module docstring)."""
    resized = rgb(image).resize((proc.width, proc.height), resample=proc.resample)
    scaled = (np.asarray(resized).astype(np.float64) * proc.rescale_factor).astype(np.float32)
    normalized = (scaled - np.asarray(proc.mean, dtype=np.float32)) / np.asarray(proc.std, dtype=np.float32)
    return np.ascontiguousarray(normalized.transpose(2, 0, 1))
