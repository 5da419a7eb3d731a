"""Conversations with images -> token ids, a loss mask and pixel values (Gemma 3, Qwen2.5-VL).

A line of the data file is `{"messages": [...]}` whose `content` may be a list of parts,
as transformers' chat templates take them:

    {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"}]}

LLaMA-Factory's ShareGPT form is read too: `{"conversations": [{"from": "human", "value":
"<image>What is it?"}, {"from": "gpt", "value": ...}], "images": ["cat.png"]}`, each `<image>`
taking the next path of `images` (`sharegpt_messages`). Image paths are relative to the data
file's folder. The conversation is rendered by the
checkpoint's chat template (Gemma 3's writes <start_of_image> for each image part), then,
as Gemma3Processor does, each <start_of_image> becomes "\\n\\n<start_of_image>", the image's
mm_tokens_per_image image tokens, "<end_of_image>\\n\\n". Qwen2.5-VL's template writes
<|vision_start|><|image_pad|><|vision_end|>, and as Qwen2_5_VLProcessor does, the <|image_pad|>
is repeated once per token of that image (its size: megaft.data.qwen_images). The text is
tokenized once. The
assistant spans found on the rendered text (megaft.data.chat) move with the expansion, so
data.train_on keeps its meaning; the image tokens are never targets (with train_on=all
neither: predicting a placeholder teaches nothing).

Never cut an image: a conversation longer than data.seq_len is dropped whole and counted
(`ImageData.dropped_long`, with its FILE:LINE); nothing is truncated."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from megaft.data.chat import ChatEncoder
from megaft.data.errors import DataError
from megaft.data.formats import checked_turns
from megaft.data.images import ImageProcessing, load_image, read_json
from megaft.data.jsonl import scan_json_lines, where
from megaft.data.qwen_images import QwenImageProcessing

PART_TYPES = ("text", "image")
IMAGE_PLACEHOLDER = "<image>"  # LLaMA-Factory's ShareGPT placeholder
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_FIX = 'fix: write each part as {"type": "text", "text": str} or {"type": "image", "image": PATH}'


@dataclass
class ImageSample:
    """One conversation: ids and targets (as megaft.data.encode.Encoded) and its images'
    pixels [images, 3, height, width] float32 (Gemma 3) or [patches, patch_dim] (Qwen2.5-VL, with
    `grids`), in the order their tokens appear."""
    ids: list
    target: list
    pixels: np.ndarray
    grids: np.ndarray | None = None  # Qwen2.5-VL: [images, 3] (t, h, w) of the patches in `pixels`


@dataclass
class ImageData:
    samples: list = field(default_factory=list)
    dropped_long: int = 0  # conversations longer than data.seq_len: dropped whole, never cut
    dropped_lines: list = field(default_factory=list)  # FILE:LINE of each, for the log


def sharegpt_messages(obj: dict) -> list[dict]:
    """LLaMA-Factory's ShareGPT form with images: `<image>` placeholders in the turns' values, the
    files in an `images` list in order; as messages with text and image parts."""
    turns = checked_turns(obj["conversations"], "conversations", "from", "value")
    images = obj.get("images") or []
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise DataError("'images' must be a list of paths; fix: \"images\": [\"img/a.png\", ...]")
    if isinstance(obj.get("system"), str) and obj["system"]:
        turns = [{"from": "system", "value": obj["system"]}] + turns
    messages, left = [], list(images)
    for i, turn in enumerate(turns):
        speaker, value = turn.get("from"), turn.get("value")
        if speaker not in SHAREGPT_ROLES or not isinstance(value, str):
            raise DataError(f"'conversations'[{i}] needs \"from\" (human, gpt or system) and a \"value\" string")
        pieces = value.split(IMAGE_PLACEHOLDER)
        if len(pieces) == 1:
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
            continue
        parts = []
        for j, piece in enumerate(pieces):
            if j:
                if not left:
                    raise DataError(f"'conversations'[{i}] has more {IMAGE_PLACEHOLDER} placeholders than 'images' "
                                    "lists; fix: one path in 'images' per placeholder, in order")
                parts.append({"type": "image", "image": left.pop(0)})
            if piece:
                parts.append({"type": "text", "text": piece})
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": parts})
    if left:
        raise DataError(f"'images' lists {len(images)} paths for {len(images) - len(left)} {IMAGE_PLACEHOLDER} "
                        "placeholders; fix: one placeholder per image, where it appears in the turn")
    return messages


def parse_image_chat(obj: object, base_dir: str) -> tuple[list[dict], list[str]]:
    """(messages as the template takes them, image paths resolved against `base_dir`), from
    `{"messages": [...]}` or ShareGPT's `{"conversations": [...], "images": [...]}`."""
    if isinstance(obj, dict) and "conversations" in obj and "messages" not in obj:
        obj = {"messages": sharegpt_messages(obj)}
    if not isinstance(obj, dict) or "messages" not in obj:
        raise DataError('expected {"messages": [...]} (content a string or a list of text and image parts) or '
                        '{"conversations": [...], "images": [...]}')
    messages, paths = [], []
    for i, turn in enumerate(checked_turns(obj["messages"], "messages", "role", "content")):
        where_ = f"'messages'[{i}]"
        role, content = turn.get("role"), turn.get("content")
        if role not in ("system", "user", "assistant"):
            raise DataError(f"{where_} has role {role!r}; fix: system, user or assistant (tool turns with images "
                            "are not supported)")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise DataError(f"{where_}: 'content' must be a string or a list of parts; {_FIX}")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES or not isinstance(part.get(kind), str):
                raise DataError(f"{where_}['content'][{j}] is not a text or image part; {_FIX}")
            if kind == "image":
                if role == "assistant":
                    raise DataError(f"{where_}: an assistant turn holds an image; fix: images go in user turns")
                paths.append(os.path.join(base_dir, part["image"]))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        messages.append({"role": role, "content": parts})
    return messages, paths


def expand_images(text: str, spans: list, proc, sequences: list[str]) -> tuple[str, list]:
    """Each image marker of the rendered `text` (Gemma 3: <start_of_image>; Qwen2.5-VL: <|image_pad|>)
    replaced by its image's whole sequence; the character `spans` (assistant output) moved by what
    was inserted before them."""
    marker = proc.marker
    pieces = text.split(marker)
    if len(pieces) - 1 != len(sequences):
        raise DataError(f"the rendered conversation holds {len(pieces) - 1} {marker} for {len(sequences)} image "
                        f"parts; fix: one image part per image (and no literal {marker} in the text), and a chat "
                        "template that writes it for image parts (the checkpoint's own)")
    ends, at = [], 0  # each marker's end in the rendered text, and how much its image adds
    for piece, seq in zip(pieces[:-1], sequences):
        at += len(piece) + len(marker)
        ends.append((at, len(seq) - len(marker)))

    def moved(pos: int) -> int:
        return pos + sum(grow for end, grow in ends if end <= pos)

    out = pieces[0] + "".join(seq + piece for seq, piece in zip(sequences, pieces[1:]))
    return out, [(moved(a), moved(b)) for a, b in spans]


def image_processing(ckpt: str):
    """The image processing of the checkpoint in `ckpt`: Qwen2.5-VL's (patches of each image's own
    size) for model_type qwen2_5_vl, else Gemma 3's (megaft.data.images)."""
    config = read_json(os.path.join(ckpt, "config.json"))
    if config.get("model_type") == "qwen2_5_vl":
        return QwenImageProcessing.from_checkpoint(ckpt, config.get("vision_config") or {})
    return ImageProcessing.from_checkpoint(ckpt)


class ImageChatEncoder:
    """Encodes conversations with images through a ChatEncoder (template, train_on)."""

    def __init__(self, chat: ChatEncoder, proc: ImageProcessing):
        self.chat, self.proc = chat, proc
        self.image_id = chat.tok.token_to_id(proc.image_token)
        missing = [t for t in (proc.boi, proc.eoi, proc.image_token) if chat.tok.token_to_id(t) is None]
        if missing:
            raise DataError(f"the tokenizer lacks the image tokens {missing}; fix: the checkpoint's own tokenizer")

    def encode(self, messages: list[dict], paths: list[str]) -> ImageSample:
        images = [self.proc.image(load_image(p)) for p in paths]  # (pixels, grid, tokens) of each
        text, spans = self.chat.render(messages)
        text, spans = expand_images(text, spans, self.proc, [self.proc.sequence(n) for _, _, n in images])
        enc = self.chat.encode_rendered(messages, text, spans)
        target = [t and i != self.image_id for t, i in zip(enc.target, enc.ids)]
        if not images:
            return ImageSample(enc.ids, target, self.proc.empty, self._grids([]))
        pixels = np.stack([p for p, _, _ in images]) if images[0][1] is None else np.concatenate(
            [p for p, _, _ in images])  # Gemma 3: [images, 3, H, W]; Qwen2.5-VL: the patches of all [n, dim]
        return ImageSample(enc.ids, target, pixels, self._grids([g for _, g, _ in images]))

    def _grids(self, grids: list) -> np.ndarray | None:
        """[images, 3] (t, h, w) in patches (Qwen2.5-VL), None for fixed-size images (Gemma 3)."""
        return None if isinstance(self.proc, ImageProcessing) else np.asarray(grids, np.int64).reshape(-1, 3)


def read_image_chat(path: str, encoder: ImageChatEncoder, seq_len: int) -> ImageData:
    """Every conversation of the JSONL file `path` within `seq_len` tokens; longer ones are
    dropped whole and counted, never cut. Raises DataError(FILE:LINE: ...)."""
    base = os.path.dirname(os.path.abspath(path))
    out = ImageData()
    for lineno, parsed, problem in scan_json_lines(path, lambda obj: parse_image_chat(obj, base), "conversations"):
        if problem is not None:
            raise DataError(f"{where(path, lineno)}: {problem}")
        try:
            sample = encoder.encode(*parsed)
        except DataError as e:
            raise DataError(f"{where(path, lineno)}: {e}") from None
        if len(sample.ids) > seq_len:
            out.dropped_long += 1
            out.dropped_lines.append(where(path, lineno))
            continue
        out.samples.append(sample)
    return out


def image_source_problems(path: str, limit: int) -> tuple[list[str], bool]:
    """check_data's scan of an image chat file (validation, before any rank starts): at most
    `limit` "LINE: problem" strings (a line that does not parse, an image file that is missing),
    and True (the file holds conversations: the template check applies)."""
    base, problems = os.path.dirname(os.path.abspath(path)), []
    for lineno, parsed, problem in scan_json_lines(path, lambda obj: parse_image_chat(obj, base), "conversations"):
        if problem is None:
            missing = [p for p in parsed[1] if not os.path.isfile(p)]
            problem = f"image {missing[0]} is not a file; fix: image paths are relative to the data file" \
                if missing else None
        if problem is not None:
            problems.append(f"{where(path, lineno)}: {problem}")
        if len(problems) >= limit:
            break
    return problems, True


@dataclass
class ImageBatch:
    """Rows of conversations with images, right-padded to the longest: input_ids [rows, seq],
    labels [rows, seq] (the next token where it is a target, else -100), pixels [images, 3, H, W]
    (the rows' images in row order, as the model consumes them)."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    pixels: torch.Tensor
    grids: torch.Tensor | None = None  # Qwen2.5-VL: [images, 3] (t, h, w) of the rows' images, in order

    @property
    def n_targets(self) -> int:
        return int((self.labels != -100).sum())


def collate(samples: list, pad_id: int) -> ImageBatch:
    """The ImageBatch of `samples` (ImageSample): each row's labels are its ids shifted left where
    the next token is a target; padding is never a target."""
    seq = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), seq), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), seq), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s.ids)] = torch.tensor(s.ids)
        nxt = torch.tensor(s.ids[1:])
        labels[row, :len(s.ids) - 1] = torch.where(torch.tensor(s.target[1:]), nxt, -100)
    pixels = [torch.from_numpy(s.pixels) for s in samples if len(s.pixels)]
    first = samples[0].pixels
    grids = None if samples[0].grids is None else torch.from_numpy(np.concatenate([s.grids for s in samples]))
    return ImageBatch(ids, labels, torch.cat(pixels) if pixels else torch.zeros((0,) + first.shape[1:]), grids)
