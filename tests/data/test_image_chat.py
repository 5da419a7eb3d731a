"""Conversations with images (megaft.data.images, megaft.data.image_chat) against transformers'
Gemma3Processor: the same token ids (the image's tokens expanded as the processor expands them)
and bit-identical pixel values for RGB, RGBA, grayscale and palette images; train_on=assistant
trains the answers and never the image tokens; a conversation longer than data.seq_len is
dropped whole and counted, never cut; malformed parts are refused with FILE:LINE."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from data.image_fixture import TOKENS_PER_IMAGE, make_processor, write_images
from megaft.data.chat import ChatEncoder
from megaft.data.errors import DataError
from megaft.data.image_chat import ImageChatEncoder, parse_image_chat, read_image_chat
from megaft.data.images import ImageProcessing, pixel_values
from megaft.data.templates import load_chat_template
from megaft.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.exact


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    processor = make_processor(str(root / "ckpt"))
    names = write_images(str(root / "data" / "img"))
    return str(root), processor, names


def _encoder(ckpt: str, train_on: str = "assistant") -> ImageChatEncoder:
    tok = load_tokenizer(ckpt)
    chat = ChatEncoder(tok, load_chat_template("auto", ckpt), train_on)
    return ImageChatEncoder(chat, ImageProcessing.from_checkpoint(ckpt))


def _conversation(names: dict, images: list[str]) -> dict:
    return {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": f"img/{names[images[0]]}"},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And these?"}] + [
            {"type": "image", "image": f"img/{names[m]}"} for m in images[1:]]},
        {"role": "assistant", "content": [{"type": "text", "text": "Dogs."}]}]}


def _transformers(processor, record: dict, base: str):
    """The processor's own output for the record (image paths made absolute for it)."""
    messages = json.loads(json.dumps(record["messages"]))
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image":
                part["image"] = os.path.join(base, part["image"])
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


def test_tokens_and_pixels_equal_the_processor(setup):
    root, processor, names = setup
    enc = _encoder(os.path.join(root, "ckpt"))
    image_id = processor.tokenizer.image_token_id
    for images in (["RGB", "RGBA"], ["L", "P", "RGB"]):
        record = _conversation(names, images)
        want = _transformers(processor, record, os.path.join(root, "data"))
        got = enc.encode(*parse_image_chat(record, os.path.join(root, "data")))
        assert got.ids == want["input_ids"][0].tolist()
        assert got.ids.count(image_id) == TOKENS_PER_IMAGE * len(images)
        assert got.pixels.dtype == np.float32 and got.pixels.shape == (len(images), 3, 28, 28)
        assert torch.equal(torch.from_numpy(got.pixels), want["pixel_values"])  # bit for bit
        # transformers' token_type_ids (its bidirectional mask) mark exactly the image tokens
        assert want["token_type_ids"][0].tolist() == [int(i == image_id) for i in got.ids]


def test_pixels_of_an_image_in_memory_equal_the_image_processor(setup):
    """An image handed over in memory (alpha composited onto white by the processor)."""
    root, processor, names = setup
    proc = ImageProcessing.from_checkpoint(os.path.join(root, "ckpt"))
    for mode, name in names.items():
        with Image.open(os.path.join(root, "data", "img", name)) as image:
            image.load()
            want = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
            assert torch.equal(torch.from_numpy(pixel_values(image, proc)), want), mode


def test_assistant_targets_skip_the_images(setup):
    root, processor, names = setup
    base = os.path.join(root, "data")
    record = _conversation(names, ["RGB", "L"])
    tok = processor.tokenizer
    for train_on, want in (("assistant", "A cat.<end_of_turn>Dogs.<end_of_turn>"), ("last", "Dogs.<end_of_turn>")):
        got = _encoder(os.path.join(root, "ckpt"), train_on).encode(*parse_image_chat(record, base))
        assert "".join(tok.convert_ids_to_tokens([i for i, t in zip(got.ids, got.target) if t])) == want
    everything = _encoder(os.path.join(root, "ckpt"), "all").encode(*parse_image_chat(record, base))
    targets = [i for i, t in zip(everything.ids, everything.target) if t]
    assert tok.image_token_id not in targets and tok.boi_token_id in targets  # placeholders never trained
    assert len(targets) == len(everything.ids) - 1 - 2 * TOKENS_PER_IMAGE


def test_too_long_is_dropped_never_cut(setup, tmp_path):
    root, _, names = setup
    data = tmp_path / "chat.jsonl"
    os.symlink(os.path.join(root, "data", "img"), tmp_path / "img")
    short = {"messages": [{"role": "user", "content": [{"type": "image", "image": f"img/{names['RGB']}"},
                                                       {"type": "text", "text": "Hi"}]},
                          {"role": "assistant", "content": "Red."}]}
    long = _conversation(names, ["RGB", "L", "P"])
    data.write_text("\n".join(json.dumps(r) for r in (short, long, short)) + "\n")
    enc = _encoder(os.path.join(root, "ckpt"))
    lengths = [len(enc.encode(*parse_image_chat(r, str(tmp_path))).ids) for r in (short, long)]
    assert lengths[0] < lengths[1]
    out = read_image_chat(str(data), enc, seq_len=lengths[1] - 1)
    assert (len(out.samples), out.dropped_long, out.dropped_lines) == (2, 1, [f"{data}:2"])
    assert all(len(s.ids) == lengths[0] and len(s.pixels) == 1 for s in out.samples)  # whole, with its image
    kept = read_image_chat(str(data), enc, seq_len=lengths[1])
    assert (len(kept.samples), kept.dropped_long) == (3, 0)
    assert len(kept.samples[1].ids) == lengths[1] and len(kept.samples[1].pixels) == 3


@pytest.mark.parametrize("line, match", [
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}]},
     r"chat.jsonl:1: 'messages'\[0\]\['content'\]\[0\] is not a text or image part; fix"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "img/missing.png"}]}]},
     r"chat.jsonl:1: image .*missing.png not found; fix: image paths are relative to the data file's folder"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "<start_of_image>"},
                                                {"type": "image", "image": "img/rgb.png"}]}]},
     r"chat.jsonl:1: the rendered conversation holds 2 <start_of_image> for 1 image parts"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "image": "img/rgb.png"}]}]},
     r"an assistant turn holds an image; fix: images go in user turns"),
])
def test_refusals_name_the_line(setup, tmp_path, line, match):
    root, _, _ = setup
    os.symlink(os.path.join(root, "data", "img"), tmp_path / "img")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(line) + "\n")
    with pytest.raises(DataError, match=match):
        read_image_chat(str(data), _encoder(os.path.join(root, "ckpt")), seq_len=1000)


def test_sharegpt_images_read_as_the_messages_form(setup):
    """LLaMA-Factory's `<image>` placeholders with an `images` list give the same sample as the
    equivalent messages; the counts must agree."""
    root, _, names = setup
    base = os.path.join(root, "data")
    sharegpt = {"system": "Be brief.", "images": [f"img/{names['RGB']}", f"img/{names['L']}", f"img/{names['P']}"],
                "conversations": [{"from": "human", "value": "<image>What is this?"},
                                  {"from": "gpt", "value": "A cat."},
                                  {"from": "human", "value": "And these?<image><image>"},
                                  {"from": "gpt", "value": "Dogs."}]}
    enc = _encoder(os.path.join(root, "ckpt"))
    got = enc.encode(*parse_image_chat(sharegpt, base))
    want = enc.encode(*parse_image_chat(_conversation(names, ["RGB", "L", "P"]), base))
    assert (got.ids, got.target) == (want.ids, want.target) and np.array_equal(got.pixels, want.pixels)
    for images, match in ((sharegpt["images"][:2], "more <image> placeholders than 'images' lists"),
                          (sharegpt["images"] + ["img/x.png"], "'images' lists 4 paths for 3 <image> placeholders")):
        with pytest.raises(DataError, match=match):
            parse_image_chat({**sharegpt, "images": images}, base)
