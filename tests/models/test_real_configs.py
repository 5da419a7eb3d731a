"""The config.json files of published checkpoints (tests/models/real_configs/, written from
the files as published on the Hugging Face Hub: no network here, so not downloaded, and the
weights are not needed) read into the models they describe: no harmless key is refused,
and each family's features come through. The multimodal Gemma 3 config (whose text_config
lists only what differs from transformers' defaults) becomes a complete text config."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megaft.models.hf import hf_model_config
from megaft.models.multimodal import text_config

HERE = os.path.join(os.path.dirname(__file__), "real_configs")

# name -> (arch, layers, heads, kv heads, head_dim, window of layer 0, of the last layer, tied)
EXPECTED = {
    "llama-3.1-8b-instruct": ("llama", 32, 32, 8, 128, None, None, False),
    "llama-3.2-1b": ("llama", 16, 32, 8, 64, None, None, True),
    "qwen2.5-7b-instruct": ("qwen2", 28, 28, 4, 128, None, None, False),
    "qwen3-8b": ("qwen3", 36, 32, 8, 128, None, None, False),
    "mistral-7b-instruct-v0.3": ("mistral", 32, 32, 8, 128, None, None, False),
    "gemma-2-9b-it": ("gemma2", 42, 16, 8, 256, 4096, None, True),
    "gemma-3-1b-it": ("gemma3_text", 26, 4, 1, 256, 512, 512, True),
}


def _folder(tmp_path, raw: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_configs_read_as_their_models(tmp_path, name):
    shutil.copyfile(os.path.join(HERE, f"{name}.json"), tmp_path / "config.json")
    cfg = hf_model_config(str(tmp_path))
    arch, layers, heads, kv, hd, first, last, tied = EXPECTED[name]
    assert (cfg.arch, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hd) == (arch, layers, heads, kv, hd)
    assert (cfg.window(0), cfg.window(layers - 1), cfg.tie_embeddings) == (first, last, tied)
    if name.startswith("llama-3"):
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.max_seq_len == 131072
    if name == "gemma-2-9b-it":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.sandwich_norms, cfg.window(1)) == (50.0, 30.0, True, None)
    if name == "gemma-3-1b-it":  # 5 sliding layers, then a global one: layer 5 is global
        assert cfg.window(5) is None and cfg.rope_local == {"rope_theta": 10000.0} and cfg.rope_theta == 1e6
        assert cfg.qk_norm and cfg.query_pre_attn_scalar == 256 and cfg.extra["eos_token_id"] == [1, 106]


def test_the_multimodal_gemma3_text_config_is_completed_with_transformers_defaults(tmp_path):
    raw = json.load(open(os.path.join(HERE, "gemma-3-4b-it.json")))
    text = text_config(raw, "config.json")
    cfg = hf_model_config(_folder(tmp_path, text))
    assert (cfg.arch, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hd, cfg.vocab_size) == \
        ("gemma3_text", 2560, 34, 8, 4, 256, 262208)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.rope_local == {"rope_theta": 10000.0}
    assert (cfg.window(0), cfg.window(5), cfg.extra["eos_token_id"]) == (1024, None, [1, 106])


def test_a_mistral_null_window_is_full_attention_and_an_omitted_one_is_4096(tmp_path):
    """Mistral v0.2+ writes sliding_window null (no window); v0.1 configs may omit it (4096)."""
    raw = json.load(open(os.path.join(HERE, "mistral-7b-instruct-v0.3.json")))
    assert hf_model_config(_folder(tmp_path, raw)).window(0) is None
    del raw["sliding_window"]
    assert hf_model_config(_folder(tmp_path, raw)).window(0) == 4096


@pytest.mark.parametrize("name", ["gemma-2-9b-it", "gemma-3-1b-it"])
def test_a_null_window_means_full_attention_in_every_family_that_reads_one(tmp_path, name):
    """The rule lives in one place (megaft.models.arch.spec.window_field), not in Mistral's spec."""
    raw = {**json.load(open(os.path.join(HERE, f"{name}.json"))), "sliding_window": None}
    raw.pop("sliding_window_size", None)
    cfg = hf_model_config(_folder(tmp_path, raw))
    assert all(cfg.window(i) is None for i in range(cfg.n_layers))


def test_gemma2_window_size_must_agree_with_its_window(tmp_path):
    from megaft.models.hf import HFCheckpointError

    raw = {**json.load(open(os.path.join(HERE, "gemma-2-9b-it.json"))), "sliding_window_size": 2048}
    with pytest.raises(HFCheckpointError, match="sliding_window_size=2048 differs from sliding_window=4096"):
        hf_model_config(_folder(tmp_path, raw))
