"""Conversations with images for Qwen2.5-VL (megaft.data.qwen_images, megaft.data.image_chat)
against transformers' Qwen2_5_VLProcessor with its Pillow image processor: the same token ids
(each <|image_pad|> expanded to its image's token count), bit-identical flattened patches and
the same grids, for four image sizes that take smart_resize's three branches, in the messages
form and in LLaMA-Factory's ShareGPT form; train_on=assistant trains the answers and never the
image tokens; a conversation longer than data.seq_len is dropped whole and counted, never cut."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from data.image_fixture import write_images
from data.qwen_image_fixture import MERGE, make_qwen_processor
from megaft.data.chat import ChatEncoder
from megaft.data.errors import DataError
from megaft.data.image_chat import ImageChatEncoder, collate, image_processing, parse_image_chat, read_image_chat
from megaft.data.templates import load_chat_template
from megaft.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.exact


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_images")
    processor = make_qwen_processor(str(root / "ckpt"))
    names = write_images(str(root / "data" / "img"))
    return str(root), processor, names


def _encoder(ckpt: str, train_on: str = "assistant") -> ImageChatEncoder:
    chat = ChatEncoder(load_tokenizer(ckpt), load_chat_template("auto", ckpt), train_on)
    return ImageChatEncoder(chat, image_processing(ckpt))


def _conversation(names: dict, images: list[str]) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": f"img/{names[images[0]]}"},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And these?"}] + [
            {"type": "image", "image": f"img/{names[m]}"} for m in images[1:]]},
        {"role": "assistant", "content": [{"type": "text", "text": "Dogs."}]}]}


def _sharegpt(names: dict, images: list[str]) -> dict:
    """The same conversation as _conversation's in ShareGPT form."""
    return {"conversations": [{"from": "human", "value": "<image>What is this?"}, {"from": "gpt", "value": "A cat."},
                              {"from": "human", "value": "And these?" + "<image>" * (len(images) - 1)},
                              {"from": "gpt", "value": "Dogs."}],
            "images": [f"img/{names[m]}" for m in images]}


def _transformers(processor, record: dict, base: str):
    messages = json.loads(json.dumps(record["messages"]))
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image":
                part["image"] = os.path.join(base, part["image"])
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


def test_tokens_patches_and_grids_equal_the_processor(setup):
    root, processor, names = setup
    base = os.path.join(root, "data")
    enc = _encoder(os.path.join(root, "ckpt"))
    image_id = processor.image_token_id
    grids = set()
    for images in (["RGB", "RGBA"], ["L", "P", "RGB"], ["P", "RGBA", "L", "RGB"]):
        want = _transformers(processor, _conversation(names, images), base)
        for record in (_conversation(names, images), _sharegpt(names, images)):
            got = enc.encode(*parse_image_chat(record, base))
            assert got.ids == want["input_ids"][0].tolist()
            assert torch.equal(torch.from_numpy(got.grids), want["image_grid_thw"])
            tokens = (want["image_grid_thw"].prod(-1) // MERGE ** 2).sum()
            assert got.ids.count(image_id) == tokens
            assert got.pixels.dtype == np.float32
            assert torch.equal(torch.from_numpy(got.pixels), want["pixel_values"])  # bit for bit
        grids |= {tuple(g) for g in got.grids.tolist()}
    # shrunk to max_pixels (30x41), grown to min_pixels (17x23), shrunk (50x20) and rounded (33x33)
    assert grids == {(1, 6, 8), (1, 12, 4), (1, 8, 8)}


def test_assistant_targets_skip_the_images(setup):
    root, processor, names = setup
    base = os.path.join(root, "data")
    record = _conversation(names, ["RGB", "L"])
    tok = processor.tokenizer
    for train_on, want in (("assistant", "A cat.<|im_end|>Dogs.<|im_end|>"), ("last", "Dogs.<|im_end|>")):
        got = _encoder(os.path.join(root, "ckpt"), train_on).encode(*parse_image_chat(record, base))
        assert "".join(tok.convert_ids_to_tokens([i for i, t in zip(got.ids, got.target) if t])) == want
    everything = _encoder(os.path.join(root, "ckpt"), "all").encode(*parse_image_chat(record, base))
    targets = [i for i, t in zip(everything.ids, everything.target) if t]
    assert processor.image_token_id not in targets
    assert len(targets) == len(everything.ids) - 1 - everything.ids.count(processor.image_token_id)


def test_collate_keeps_the_grids_in_row_order(setup):
    root, _, names = setup
    enc = _encoder(os.path.join(root, "ckpt"))
    base = os.path.join(root, "data")
    a = enc.encode(*parse_image_chat(_conversation(names, ["RGB", "L"]), base))
    b = enc.encode(*parse_image_chat({"messages": [{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello."}]}, base))
    c = enc.encode(*parse_image_chat(_conversation(names, ["P"]), base))
    batch = collate([a, b, c], pad_id=0)
    assert torch.equal(batch.grids, torch.from_numpy(np.concatenate([a.grids, c.grids])))
    assert torch.equal(batch.pixels, torch.from_numpy(np.concatenate([a.pixels, c.pixels])))
    assert b.grids.shape == (0, 3) and b.pixels.shape == (0, a.pixels.shape[1])


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
    out = read_image_chat(str(data), enc, seq_len=lengths[1] - 1)
    assert (len(out.samples), out.dropped_long, out.dropped_lines) == (2, 1, [f"{data}:2"])
    assert all(len(s.ids) == lengths[0] and len(s.grids) == 1 for s in out.samples)  # whole, with its image
    kept = read_image_chat(str(data), enc, seq_len=lengths[1])
    assert (len(kept.samples), kept.dropped_long) == (3, 0) and len(kept.samples[1].grids) == 3


def test_processor_that_disagrees_with_the_tower_is_refused(setup, tmp_path):
    root, _, _ = setup
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    for name in os.listdir(os.path.join(root, "ckpt")):
        with open(os.path.join(root, "ckpt", name), "rb") as src, open(ckpt / name, "wb") as dst:
            dst.write(src.read())
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"patch_size": 14}}))
    with pytest.raises(DataError, match="patch_size=4 but config.json's vision_config has patch_size=14"):
        image_processing(str(ckpt))
