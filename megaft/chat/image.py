"""`megaft-chat HF_DIR --prompt TEXT --image PATH`: one answer about an image from a
vision-language Gemma 3 checkpoint (megaft.models.vision), on this process's device.

The user turn is the image then the text, rendered by the checkpoint's chat template and
expanded as Gemma3Processor expands images (megaft.data.image_chat); the image is read and
processed as the checkpoint's processor does (megaft.data.images). Decoding runs the prompt
once with its images and caches it (megaft.inference.vision); one rank."""
from __future__ import annotations

import sys
from typing import Optional, TextIO

import torch

from megaft.chat.load import ChatError, ChatModel, compute


def image_prompt(chat: ChatModel, user: str, image: str, system: Optional[str] = None
                 ) -> tuple[list[int], torch.Tensor]:
    """(prompt ids, pixel values [1, 3, H, W]) of one user turn holding `image` and `user`."""
    from tokenizers import Tokenizer

    from megaft.data.image_chat import expand_images
    from megaft.data.images import ImageProcessing, load_image, pixel_values

    if chat.template is None:
        raise ChatError(f"{chat.origin} has no chat template to place the image with; fix: --template FILE.jinja")
    proc = ImageProcessing.from_checkpoint(chat.hf_dir)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user}]}]
    text, _ = expand_images(chat.template.render(messages, add_generation_prompt=True), [], proc, 1)
    ids = Tokenizer.from_file(chat.tokenizer).encode(text, add_special_tokens=False).ids
    return ids, torch.from_numpy(pixel_values(load_image(image), proc))[None]


def answer_image(chat: ChatModel, user: str, image: str, *, sampling, max_new_tokens: int, device: torch.device,
                 system: Optional[str] = None, out: Optional[TextIO] = None) -> str:
    """Stream the answer to `user` about `image` into `out`; returns it."""
    from tokenizers import Tokenizer

    from megaft.chat.session import TextStream
    from megaft.inference.vision import generate_with_images
    from megaft.models.vision.config import vision_language_config
    from megaft.models.vision.hf import load_vision_language_weights
    from megaft.models.vision.model import VisionLanguageModel

    out = out or sys.stdout
    model = VisionLanguageModel(vision_language_config(chat.hf_dir))
    load_vision_language_weights(model, chat.hf_dir, tp_rank=0, tp_size=1)
    model = model.to(device).eval()
    ids, pixels = image_prompt(chat, user, image, system)
    room = model.cfg.max_seq_len - len(ids)
    if room < 1:
        raise ChatError(f"the prompt with its image is {len(ids)} tokens, the model reads at most "
                        f"{model.cfg.max_seq_len}; fix: a shorter prompt")
    stream = TextStream(Tokenizer.from_file(chat.tokenizer))

    def show(_: int, token: int) -> None:
        out.write(stream.push(token))
        out.flush()

    with torch.inference_mode(), compute(chat, device):
        generate_with_images(model, ids, pixels, max_new_tokens=min(max_new_tokens, room), eos_id=chat.stop_ids,
                             device=device, sampling=sampling, on_token=show)
    out.write(stream.finish() + "\n")
    out.flush()
    return stream.text
