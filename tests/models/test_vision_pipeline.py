"""A conversation with images from a data file, end to end: megaft's reader
(megaft.data.image_chat) and model (megaft.models.vision) against transformers' Gemma3Processor
and Gemma3ForConditionalGeneration on the same file and checkpoint: the same inputs, the loss
over the assistant's tokens and every gradient equal in fp32."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from data.image_fixture import TOKENS_PER_IMAGE, write_images

from megaft.data.chat import ChatEncoder
from megaft.data.image_chat import ImageChatEncoder, collate, read_image_chat
from megaft.data.images import ImageProcessing
from megaft.data.templates import load_chat_template
from megaft.data.tokenizer import load_tokenizer
from megaft.models.vision.config import vision_language_config
from megaft.models.vision.hf import hf_names, load_vision_language_weights
from megaft.models.vision.model import VisionLanguageModel
from models.vlm_fixture import make_processor_gemma3

pytestmark = pytest.mark.exact


def test_data_file_to_loss_and_gradients_equal_transformers(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    processor = make_processor_gemma3(ckpt)
    names = write_images(str(tmp_path / "img"))
    record = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": f"img/{names['RGB']}"},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A red cat."},
        {"role": "user", "content": [{"type": "image", "image": f"img/{names['RGBA']}"},
                                     {"type": "text", "text": "And this one?"}]},
        {"role": "assistant", "content": "A dog."}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(record) + "\n")
    chat = ChatEncoder(load_tokenizer(ckpt), load_chat_template("auto", ckpt), "assistant")
    data = read_image_chat(str(tmp_path / "chat.jsonl"), ImageChatEncoder(chat, ImageProcessing.from_checkpoint(ckpt)),
                           seq_len=128)
    (sample,) = data.samples
    ids = torch.tensor([sample.ids])
    target = torch.tensor([sample.target])
    labels = torch.where(target, ids, -100)[:, 1:]  # megaft's labels: the next token where it is a target
    labels = torch.cat([labels, torch.full((1, 1), -100)], dim=1)

    messages = json.loads(json.dumps(record["messages"]))
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image":
                part["image"] = str(tmp_path / part["image"])
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(inputs["input_ids"], ids) and torch.equal(inputs["pixel_values"],
                                                                 torch.from_numpy(sample.pixels))
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                                            attn_implementation="eager").train()
    out = reference(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                    token_type_ids=inputs["token_type_ids"], labels=torch.where(target, ids, -100))
    out.loss.backward()

    model = VisionLanguageModel(vision_language_config(ckpt))
    load_vision_language_weights(model, ckpt, tp_rank=0, tp_size=1)
    loss = model.loss_sum(ids, labels, torch.from_numpy(sample.pixels)) / (labels != -100).sum()
    assert int((labels != -100).sum()) == len("A red cat.") + len("A dog.") + 2  # the answers, their <end_of_turn>
    # fp32 on both sides, sums in other orders: ~1e-7 relative; 1e-5 of each tensor's largest element
    torch.testing.assert_close(loss, out.loss.detach(), atol=1e-5 * float(out.loss.detach()), rtol=0)
    loss.backward()
    reference_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        ref = next(n for n in ["model." + c if not c.startswith("model.") else c
                               for c in hf_names(name, "gemma3_text")] if n in reference_grads)
        want = reference_grads[ref]
        scale = want.abs().max()
        if name.startswith("vision_tower.") and name.endswith("k_proj.bias"):  # zero but for rounding (test_vision)
            scale = reference_grads[ref.replace("k_proj", "q_proj")].abs().max()
        assert scale > 0, name
        torch.testing.assert_close(param.grad, want, atol=float(1e-5 * scale), rtol=0, msg=lambda m: f"{name}: {m}")


def test_chat_answers_about_an_image_as_transformers_generates(tmp_path, capsys):
    """`megaft-chat HF_DIR --prompt TEXT --image PATH` prints the greedy answer transformers' generate
    gives for the processor's inputs of the same turn, on one rank and at tp=2."""
    from tokenizers import Tokenizer

    from megaft.chat.cli import main

    ckpt = str(tmp_path / "ckpt")
    processor = make_processor_gemma3(ckpt)
    image = str(tmp_path / "img" / write_images(str(tmp_path / "img"))["RGBA"])
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is this?"}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                                            attn_implementation="eager").eval()
    eos = processor.tokenizer.eos_token_id
    new = reference.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                             pad_token_id=processor.tokenizer.pad_token_id)[0, inputs["input_ids"].shape[1]:].tolist()
    new = new[:new.index(eos)] if eos in new else new
    assert new, "transformers' answer is empty: the comparison would prove little"
    text = Tokenizer.from_file(f"{ckpt}/tokenizer.json").decode(new) + "\n"
    for ranks in ("1", "2"):  # one rank, then tensor parallel over two local ranks (gloo)
        assert main([ckpt, "--prompt", "What is this?", "--image", image, "--max-new-tokens", "6", "device=cpu",
                     f"parallel.tp={ranks}"]) == 0
        assert capsys.readouterr().out == text, ranks
    assert main([ckpt, "--image", image]) == 2
    assert "--image needs --prompt" in capsys.readouterr().err


def test_export_carries_the_processor(tmp_path):
    """An export beside its tokenizer's processor files reads back as the same processor."""
    from megaft.models.vision.hf import export_vision_language

    ckpt = str(tmp_path / "ckpt")
    make_processor_gemma3(ckpt)
    model = VisionLanguageModel(vision_language_config(ckpt))
    load_vision_language_weights(model, ckpt, tp_rank=0, tp_size=1)
    out = export_vision_language(model, str(tmp_path / "out"), tokenizer_json=ckpt, tp_group=None, is_writer=True)
    assert ImageProcessing.from_checkpoint(out) == ImageProcessing.from_checkpoint(ckpt)
    again = transformers.AutoProcessor.from_pretrained(out)
    assert (type(again).__name__, again.image_seq_length) == ("Gemma3Processor", TOKENS_PER_IMAGE)


def test_a_collated_batch_gives_the_token_weighted_loss(tmp_path):
    """Two conversations of different lengths and image counts, read and collated into one padded
    batch (megaft.data.image_chat.collate): the batch's mean loss is transformers' per-conversation
    losses weighted by their target counts."""
    ckpt = str(tmp_path / "ckpt")
    processor = make_processor_gemma3(ckpt)
    names = write_images(str(tmp_path / "img"))

    def conversation(images, answer):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": f"img/{names[m]}"}
                                                          for m in images] + [{"type": "text", "text": "Which?"}]},
                             {"role": "assistant", "content": answer}]}

    records = [conversation(["RGB", "L"], "Both are noise."), conversation(["P"], "A dog.")]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    chat = ChatEncoder(load_tokenizer(ckpt), load_chat_template("auto", ckpt), "assistant")
    data = read_image_chat(str(tmp_path / "chat.jsonl"), ImageChatEncoder(chat, ImageProcessing.from_checkpoint(ckpt)),
                           seq_len=128)
    batch = collate(data.samples, pad_id=processor.tokenizer.pad_token_id)
    assert batch.input_ids.shape[0] == 2 and batch.pixels.shape[0] == 3
    assert batch.n_targets == len("Both are noise.") + len("A dog.") + 2
    model = VisionLanguageModel(vision_language_config(ckpt))
    load_vision_language_weights(model, ckpt, tp_rank=0, tp_size=1)
    with torch.no_grad():
        ours = model.loss_sum(batch.input_ids, batch.labels, batch.pixels) / batch.n_targets
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                                            attn_implementation="eager").eval()
    total, count = 0.0, 0
    for record, sample in zip(records, data.samples):
        messages = json.loads(json.dumps(record["messages"]))
        for part in messages[0]["content"]:
            if part["type"] == "image":
                part["image"] = str(tmp_path / part["image"])
        inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        labels = torch.where(torch.tensor([sample.target]), inputs["input_ids"], -100)
        with torch.no_grad():
            loss = reference(**inputs, labels=labels).loss
        n = int((labels[:, 1:] != -100).sum())
        total, count = total + float(loss) * n, count + n
    # fp32, sums in other orders: 1e-5 of the loss
    assert count == batch.n_targets and abs(float(ours) - total / count) <= 1e-5 * total / count
