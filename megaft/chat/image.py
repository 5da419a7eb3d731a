"""`megaft-chat HF_DIR --prompt TEXT --image PATH`: one answer about an image from a
vision-language Gemma 3 checkpoint (megaft.models.vision).

The user turn is the image then the text, rendered by the checkpoint's chat template and
expanded as Gemma3Processor expands images (megaft.data.image_chat); the image is read and
processed as the checkpoint's processor does (megaft.data.images). The engine's ranks
(megaft.chat.engine: one, or tensor parallel) decode it with megaft.inference.vision: the
prompt runs once with its images and is cached."""
from __future__ import annotations

import sys
from typing import Optional, TextIO

import torch

from megaft.chat.load import ChatError, ChatModel


def image_prompt(chat: ChatModel, user: str, image: str, system: Optional[str] = None):
    """(prompt ids, the image's pixels) of one user turn holding `image` and `user`: pixel values
    [1, 3, H, W] (Gemma 3), or (patches, grids) (Qwen2.5-VL), as the checkpoint's processor makes them."""
    from tokenizers import Tokenizer

    from megaft.data.image_chat import expand_images, image_processing
    from megaft.data.images import load_image

    if chat.template is None:
        raise ChatError(f"{chat.origin} has no chat template to place the image with; fix: --template FILE.jinja")
    proc = image_processing(chat.hf_dir)
    pixels, grid, n_tokens = proc.image(load_image(image))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user}]}]
    text, _ = expand_images(chat.template.render(messages, add_generation_prompt=True), [], proc,
                            [proc.sequence(n_tokens)])
    ids = Tokenizer.from_file(chat.tokenizer).encode(text, add_special_tokens=False).ids
    if grid is not None:
        return ids, (torch.from_numpy(pixels), torch.tensor([grid]))
    return ids, torch.from_numpy(pixels)[None]


def answer_image(engine, chat: ChatModel, user: str, image: str, *, sampling, max_new_tokens: int,
                 system: Optional[str] = None, out: Optional[TextIO] = None) -> str:
    """Stream the answer to `user` about `image` into `out` (the engine's model: a
    vision-language checkpoint, one rank or tensor parallel); returns it."""
    from tokenizers import Tokenizer

    from megaft.chat.session import TextStream

    out = out or sys.stdout
    ids, pixels = image_prompt(chat, user, image, system)
    room = engine.max_len - len(ids)
    if room < 1:
        raise ChatError(f"the prompt with its image is {len(ids)} tokens, the model reads at most "
                        f"{engine.max_len}; fix: a shorter prompt")
    stream = TextStream(Tokenizer.from_file(chat.tokenizer))

    def show(token: int) -> None:
        out.write(stream.push(token))
        out.flush()

    engine.answer(ids, sampling, 0, min(max_new_tokens, room), show, pixels=pixels)
    out.write(stream.finish() + "\n")
    out.flush()
    return stream.text
