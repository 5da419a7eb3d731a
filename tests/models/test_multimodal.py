"""The text model of a multimodal Gemma 3 checkpoint (megaft.models.hf.multimodal): a tiny
Gemma3ForConditionalGeneration saved by transformers, extracted (whole and in 2+ shards
with an index), loads in megaft and in transformers' Gemma3ForCausalLM with the
multimodal model's logits on text; a changed text model merged back gives a multimodal
checkpoint whose text logits are the changed model's and whose vision tower is the
original's; the refusals name the problem and the fix."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from megaft.models.arch.spec import HFCheckpointError
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from megaft.models.hf.multimodal import extract_text_model, main, merge_text_model
from models.arch_fixture import make_hf, sample_ids
from models.hf_fixture import VOCAB, write_char_tokenizer

ATOL = 1e-5


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3_mm"))
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB + 3, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=64, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                    image_token_index=VOCAB + 2, boi_token_index=VOCAB, eoi_token_index=VOCAB + 1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights that move the logits (norms: stored w near 0)
            p.copy_(torch.randn_like(p) * (0.02 if name.endswith("norm.weight") else 0.1))
    model.save_pretrained(path)
    write_char_tokenizer(path)
    return path, model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits[..., :VOCAB]


@pytest.mark.parametrize("shard_bytes", [5 * 10**9, 64 * 1024])
def test_extracted_text_model_gives_the_multimodal_logits(tmp_path, multimodal, shard_bytes):
    src, mm = multimodal
    dst = extract_text_model(src, str(tmp_path / "text"), max_shard_bytes=shard_bytes)
    config = json.load(open(os.path.join(dst, "config.json")))
    assert (config["model_type"], config["architectures"], config["tie_word_embeddings"]) == \
        ("gemma3_text", ["Gemma3ForCausalLM"], True)
    files = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    assert (len(files) > 1) == (shard_bytes < 10**6) and os.path.isfile(os.path.join(dst, "tokenizer.json"))
    for file in files:  # the vision tower and projector stay behind
        with safe_open(os.path.join(dst, file), "pt") as f:
            assert all(k.startswith("model.layers.") or k in ("model.embed_tokens.weight", "model.norm.weight")
                       for k in f.keys()), list(f.keys())
    ids = sample_ids()
    want = _logits(mm, ids)
    cfg = hf_model_config(dst)
    assert (cfg.arch, cfg.sandwich_norms, cfg.qk_norm, cfg.query_pre_attn_scalar) == ("gemma3_text", True, True, 24)
    ours = Decoder(cfg).eval()
    load_hf_weights(ours, dst, tp_rank=0, tp_size=1)
    with torch.no_grad():
        got = ours(ids)[..., :VOCAB]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    theirs = transformers.Gemma3ForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(theirs, ids), want, atol=ATOL, rtol=0)
    assert want.abs().max() > 0.1


def test_extraction_refusals_name_the_fix(tmp_path, multimodal, capsys):
    text = str(tmp_path / "llama")
    make_hf(text, "llama3")
    with pytest.raises(HFCheckpointError, match="model_type 'llama' is not a multimodal checkpoint.*pass it to "
                                                 "model.init_from"):
        extract_text_model(text, str(tmp_path / "out"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("a user's file")
    with pytest.raises(SystemExit, match="busy: exists and is not empty; fix: choose a new folder"):
        main(["text", multimodal[0], str(busy)])
    assert (busy / "keep.txt").read_text() == "a user's file"  # nothing already saved is lost
    main(["text", multimodal[0], str(tmp_path / "fresh")])
    assert "fine-tune it with model.init_from=" in capsys.readouterr().out
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary left behind


def test_a_changed_text_model_merged_back_gives_its_logits_and_the_original_vision(tmp_path, multimodal, capsys):
    src, mm = multimodal
    text = extract_text_model(src, str(tmp_path / "text"))
    tuned = transformers.Gemma3ForCausalLM.from_pretrained(text, dtype=torch.float32).eval()
    with torch.no_grad():  # as a fine-tune would: every text tensor moves
        for p in tuned.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tuned.save_pretrained(str(tmp_path / "tuned"))
    (tmp_path / "tuned" / "chat_template.jinja").write_text("{{ messages }}")  # the run's own template
    main(["merge", src, str(tmp_path / "tuned"), str(tmp_path / "merged")])
    assert "with the text model of" in capsys.readouterr().out
    merged = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path / "merged"),
                                                                         dtype=torch.float32).eval()
    ids = sample_ids()
    torch.testing.assert_close(_logits(merged, ids), _logits(tuned, ids), atol=ATOL, rtol=0)
    assert (_logits(merged, ids) - _logits(mm, ids)).abs().max() > 1e-2  # the text model did change
    original = dict(mm.model.vision_tower.named_parameters())
    for name, p in merged.model.vision_tower.named_parameters():
        assert torch.equal(p, original[name]), name
    assert (tmp_path / "merged" / "chat_template.jinja").read_text() == "{{ messages }}"
    assert json.load(open(tmp_path / "merged" / "config.json"))["model_type"] == "gemma3"


def test_merge_refuses_another_model(tmp_path, multimodal):
    src, _ = multimodal
    other = str(tmp_path / "llama")
    make_hf(other, "llama3")
    with pytest.raises(HFCheckpointError, match="model_type 'llama', not the 'gemma3_text' text model"):
        merge_text_model(src, other, str(tmp_path / "out"))
    small = str(tmp_path / "gemma3")
    make_hf(small, "gemma3")  # a gemma3_text model of other shapes
    with pytest.raises(HFCheckpointError, match="has shape|are not the text model of"):
        merge_text_model(src, small, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
