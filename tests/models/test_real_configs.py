"""The config.json files of published checkpoints (tests/models/real_configs/, each copied
from a public repository that vendors it, as SOURCES.md says: no network here, and the
weights are not needed) read into the models they describe: no harmless key is refused,
each family's features come through, and what megaft cannot run is refused with the reason.
The multimodal Gemma 3 configs (whose text_config may list only what differs from
transformers' defaults) become complete text configs first, as `megaft.models.hf.multimodal
text` does."""
from __future__ import annotations

import json
import os
import re

import pytest

from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import HFCheckpointError
from megaft.models.hf.multimodal import MULTIMODAL, text_config

HERE = os.path.join(os.path.dirname(__file__), "real_configs")
FILES = sorted(f[:-len(".json")] for f in os.listdir(HERE) if f.endswith(".json"))
MODEL_TYPE = ("megaft imports llama, qwen2, qwen3, mistral, gemma, gemma2, gemma3_text, mixtral, qwen2_moe, qwen3_moe, "
              "olmoe, deepseek_v3 checkpoints")

# Supported: name -> (arch, layers, heads, kv heads, head_dim, window of layer 0, of the last layer, tied),
# read by hand from each file (Gemma 3 multimodal: from its text model).
SUPPORTED = {
    "allam-7b-instruct-preview": ("llama", 32, 32, 32, 128, None, None, False),
    # head_dim: the rotary part's width (qk_rope_head_dim), as transformers sets it
    "deepseek-r1": ("deepseek_v3", 61, 128, 128, 64, None, None, False),
    "dolphin-2.5-mixtral-8x7b": ("mixtral", 32, 32, 8, 128, None, None, False),
    "wizardlm-2-8x22b": ("mixtral", 56, 48, 8, 128, None, None, False),
    "gemma-2-9b-it": ("gemma2", 42, 16, 8, 256, 4096, None, True),
    "gemma-3-4b-it": ("gemma3_text", 34, 8, 4, 256, 1024, 1024, True),
    "gemma-3-27b-it": ("gemma3_text", 62, 32, 16, 128, 1024, 1024, True),
    "llama-2-7b-hf": ("llama", 32, 32, 32, 128, None, None, False),
    "llama-3.1-8b": ("llama", 32, 32, 8, 128, None, None, False),
    "llama-3.1-70b-instruct": ("llama", 80, 64, 8, 128, None, None, False),
    "llama-3.2-1b": ("llama", 16, 32, 8, 64, None, None, True),
    "llama-3.2-1b-instruct": ("llama", 16, 32, 8, 64, None, None, True),
    "llama-3.2-3b-instruct": ("llama", 28, 24, 8, 128, None, None, True),
    "medgemma-27b-it": ("gemma3_text", 62, 32, 16, 128, 1024, 1024, True),
    "mistral-7b-instruct-v0.2": ("mistral", 32, 32, 8, 128, 32768, 32768, False),
    "mistral-7b-instruct-v0.3": ("mistral", 32, 32, 8, 128, None, None, False),
    "qwen2.5-0.5b": ("qwen2", 24, 14, 2, 64, None, None, True),
    "qwen2.5-32b-instruct": ("qwen2", 64, 40, 8, 128, None, None, False),
    "qwen3-32b": ("qwen3", 64, 64, 8, 128, None, None, False),
    "qwen3-embedding-0.6b": ("qwen3", 28, 16, 8, 128, None, None, True),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 32, 4, 128, None, None, False),
    "qwen3-235b-a22b": ("qwen3_moe", 94, 64, 4, 128, None, None, False),
    "qwen3-coder-30b-a3b-instruct": ("qwen3_moe", 48, 32, 4, 128, None, None, False),
    "reflection-llama-3.1-70b": ("llama", 80, 64, 8, 128, None, None, False),
}
# Mixtures of experts: name -> (experts, top_k, each expert's inner size, shared expert's, MoE layers,
# norm_topk_prob, router_aux_loss_coef), read by hand from each file.
MOE = {
    "dolphin-2.5-mixtral-8x7b": (8, 2, 14336, 0, 32, True, 0.02),
    "wizardlm-2-8x22b": (8, 2, 16384, 0, 56, True, 0.001),
    "qwen3-30b-a3b": (128, 8, 768, 0, 48, True, 0.001),
    # one shared expert of 2048, the first 3 layers dense; transformers has no aux loss for it
    "deepseek-r1": (256, 8, 2048, 2048, 58, True, 0.0),
    "qwen3-235b-a22b": (128, 8, 1536, 0, 94, True, 0.001),
    # writes qkv_bias false, use_qk_norm true, shared_expert_intermediate_size 0, keys its class never reads
    "qwen3-coder-30b-a3b-instruct": (128, 8, 768, 0, 48, True, 0.0),
}
# Refused: name -> what the message must say.
REFUSED = {
    "phi-3-mini-128k-instruct": "model_type 'phi3' is not supported; " + MODEL_TYPE,
    "olmo-3.1-32b-instruct": "model_type 'olmo3' is not supported; " + MODEL_TYPE,
    "smollm3-3b": "model_type 'smollm3' is not supported; " + MODEL_TYPE,
    # dropout on the attention probabilities: training math megaft does not compute
    "granite-3b-code-instruct-128k": "attention_dropout=0.1 is not supported",
}
LLAMA3 = [n for n in SUPPORTED if n.startswith("llama-3.")]
GEMMA3 = ["gemma-3-4b-it", "gemma-3-27b-it", "medgemma-27b-it"]


def _file(name: str) -> dict:
    with open(os.path.join(HERE, f"{name}.json")) as f:
        return json.load(f)


def _model_raw(name: str) -> dict:
    """The config.json megaft reads for `name`: the file, or the text model of a multimodal one."""
    raw = _file(name)
    return text_config(raw, f"{name}.json") if raw.get("model_type") in MULTIMODAL else raw


def _folder(tmp_path, raw: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def test_the_corpus_is_published_configs_each_listed_in_sources():
    assert len(FILES) >= 20, FILES
    sources = open(os.path.join(HERE, "SOURCES.md")).read()
    listed = set(re.findall(r"^\| `([^`]+)\.json` \|", sources, flags=re.M))
    assert listed == set(FILES), (sorted(set(FILES) - listed), sorted(listed - set(FILES)))
    for name in FILES:  # written by transformers, not by hand
        raw = _file(name)
        assert "transformers_version" in raw and "model_type" in raw, name


def test_every_file_is_either_supported_or_refused():
    assert not set(SUPPORTED) & set(REFUSED)
    assert set(SUPPORTED) | set(REFUSED) == set(FILES), sorted(set(FILES) ^ (set(SUPPORTED) | set(REFUSED)))


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_published_configs_read_as_their_models(tmp_path, name):
    cfg = hf_model_config(_folder(tmp_path, _model_raw(name)))
    arch, layers, heads, kv, hd, first, last, tied = SUPPORTED[name]
    assert (cfg.arch, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hd) == (arch, layers, heads, kv, hd)
    assert (cfg.window(0), cfg.window(layers - 1), cfg.tie_embeddings) == (first, last, tied)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_shapes_are_the_files_own_fields(tmp_path, name):
    """Every shape, the RoPE and the windows come from the file's own fields (or, where it
    omits one, transformers' default for the family)."""
    raw = _model_raw(name)
    cfg = hf_model_config(_folder(tmp_path, raw))
    heads = raw["num_attention_heads"]
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.ffn_dim, cfg.vocab_size) == (
        raw["hidden_size"], raw["num_hidden_layers"], heads, raw["intermediate_size"], raw["vocab_size"])
    assert cfg.kv_heads == raw.get("num_key_value_heads", heads)
    assert cfg.hd == raw.get("head_dim", raw.get("qk_rope_head_dim", raw["hidden_size"] // heads))
    assert cfg.max_seq_len == raw["max_position_embeddings"] and cfg.norm_eps == raw["rms_norm_eps"]
    if "tie_word_embeddings" in raw:
        assert cfg.tie_embeddings == raw["tie_word_embeddings"]
    assert cfg.rope_theta == float(raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling")
    if scaling:
        assert cfg.rope_scaling["rope_type"] == scaling.get("rope_type", scaling.get("type"))
        assert cfg.rope_scaling["factor"] == scaling["factor"]
    else:
        assert cfg.rope_scaling is None
    windows = [cfg.window(i) for i in range(cfg.n_layers)]
    if raw["model_type"] == "mistral":  # every layer, null = none
        assert windows == [raw["sliding_window"]] * cfg.n_layers
    elif raw["model_type"] in ("qwen2", "qwen3"):  # use_sliding_window false in every published Qwen
        assert raw["use_sliding_window"] is False and windows == [None] * cfg.n_layers
    elif raw["model_type"] in ("gemma2", "gemma3_text"):
        assert set(windows) == {raw["sliding_window"], None}
        if "layer_types" in raw:
            assert windows == [None if t == "full_attention" else raw["sliding_window"] for t in raw["layer_types"]]
    else:
        assert windows == [None] * cfg.n_layers


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_published_configs_are_refused_with_the_reason(tmp_path, name):
    with pytest.raises(HFCheckpointError) as info:
        hf_model_config(_folder(tmp_path, _file(name)))
    assert REFUSED[name] in str(info.value), str(info.value)


@pytest.mark.parametrize("name", sorted(MOE))
def test_published_mixtures_of_experts_read_their_experts(tmp_path, name):
    cfg = hf_model_config(_folder(tmp_path, _file(name)))
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    assert (cfg.n_experts, cfg.top_k, cfg.expert_ffn, cfg.shared_expert_ffn_dim, moe_layers, cfg.norm_topk_prob,
            cfg.router_aux_loss_coef) == MOE[name]
    assert name in SUPPORTED and cfg.arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def test_deepseek_r1_is_read_for_planning_and_refused_for_training(tmp_path):
    """The FP8 release: its shapes, latent attention, routing and YaRN come through for megaft-plan and
    the performance model (671B parameters, about 37B of them multiplied per token, as DeepSeek-V3's
    report counts), and check_model refuses to train from it."""
    import dataclasses

    from megaft.models.checks import check_model
    from megaft.perf.counts import matmul_params, total_params

    cfg = hf_model_config(_folder(tmp_path, _file("deepseek-r1")))
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim) == (
        512, 1536, 128, 128, 192)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.router_scoring, cfg.rope_interleave) == (
        8, 4, 2.5, "sigmoid", True)
    assert cfg.rope_scaling["mscale_all_dim"] == 1.0 and cfg.extra["num_nextn_predict_layers"] == 1
    assert round(total_params(cfg) / 1e9) == 671 and round(matmul_params(cfg) / 1e9) == 37
    assert check_model(dataclasses.replace(cfg, init_from=None), 8) == []
    assert any("quant_method='fp8'" in p and "dequantize" in p for p in check_model(cfg, 8))


def test_qwen3_coder_unread_keys_are_checked_not_ignored(tmp_path):
    """Qwen3-Coder's extra keys are accepted only at the values of a Qwen3-MoE block."""
    raw = {**_file("qwen3-coder-30b-a3b-instruct"), "qkv_bias": True}
    with pytest.raises(HFCheckpointError, match="qkv_bias=True does not describe a Qwen3-MoE block"):
        hf_model_config(_folder(tmp_path, raw))


def test_granite_is_read_once_the_user_waives_the_attention_dropout(tmp_path):
    """The way out the refusal names: the rest of Granite Code (Llama with q/k/v/o and MLP
    biases, rope_theta 1e7) is supported."""
    from megaft.config.model import ModelConfig

    cfg = hf_model_config(_folder(tmp_path, _file("granite-3b-code-instruct-128k")),
                          base=ModelConfig(hf_ignore_keys=["attention_dropout"]))
    assert (cfg.arch, cfg.attention_bias, cfg.mlp_bias, cfg.rope_theta, cfg.tie_embeddings) == (
        "llama", True, True, 1e7, True)


@pytest.mark.parametrize("name", sorted(n for n in FILES if _file(n).get("model_type") in MULTIMODAL))
def test_a_multimodal_config_is_refused_as_is_and_read_through_its_text_model(tmp_path, name):
    with pytest.raises(HFCheckpointError, match="model_type 'gemma3' is not supported"):
        hf_model_config(_folder(tmp_path, _file(name)))
    assert name in SUPPORTED


@pytest.mark.parametrize("name", LLAMA3)
def test_llama3_rope(tmp_path, name):
    cfg = hf_model_config(_folder(tmp_path, _file(name)))
    factor = 32.0 if name.startswith("llama-3.2") else 8.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.max_seq_len == 131072
    assert (cfg.rope_scaling["factor"], cfg.rope_theta) == (factor, 500000.0)


def test_gemma2_features(tmp_path):
    cfg = hf_model_config(_folder(tmp_path, _file("gemma-2-9b-it")))
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sandwich_norms, cfg.window(1)) == (50.0, 30.0, True, None)
    assert cfg.query_pre_attn_scalar == 224 and cfg.extra["eos_token_id"] == 1


@pytest.mark.parametrize("name", GEMMA3)
def test_gemma3_features(tmp_path, name):
    """5 sliding layers, then a global one: layer 5 is global; local RoPE base 1e4, global 1e6."""
    cfg = hf_model_config(_folder(tmp_path, _model_raw(name)))
    assert cfg.window(5) is None and cfg.rope_local == {"rope_theta": 10000.0} and cfg.rope_theta == 1e6
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.extra["eos_token_id"] == [1, 106]
    assert cfg.query_pre_attn_scalar == {"gemma-3-4b-it": 256}.get(name, 168)


def test_gemma3_written_out_layer_types_match_the_transformers4_rule(tmp_path):
    """medgemma-27b-it (transformers 4.54) lists layer_types; gemma-3-27b-it (4.50) leaves
    them to sliding_window_pattern: the same 62 layers."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    listed = hf_model_config(_folder(tmp_path / "a", _model_raw("medgemma-27b-it")))
    rule = hf_model_config(_folder(tmp_path / "b", _model_raw("gemma-3-27b-it")))
    assert listed.layer_types == rule.layer_types and len(listed.layer_types) == 62


def test_the_multimodal_gemma3_text_config_is_completed_with_transformers_defaults(tmp_path):
    text = text_config(_file("gemma-3-4b-it"), "config.json")
    cfg = hf_model_config(_folder(tmp_path, text))
    assert (cfg.arch, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hd, cfg.vocab_size) == \
        ("gemma3_text", 2560, 34, 8, 4, 256, 262208)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.rope_local == {"rope_theta": 10000.0}
    assert (cfg.window(0), cfg.window(5), cfg.extra["eos_token_id"]) == (1024, None, [1, 106])


def test_a_mistral_null_window_is_full_attention_and_an_omitted_one_is_4096(tmp_path):
    """Mistral v0.3 writes sliding_window null (no window); v0.1 configs may omit it (4096)."""
    raw = _file("mistral-7b-instruct-v0.3")
    assert hf_model_config(_folder(tmp_path, raw)).window(0) is None
    del raw["sliding_window"]
    assert hf_model_config(_folder(tmp_path, raw)).window(0) == 4096


@pytest.mark.parametrize("name", ["gemma-2-9b-it", "medgemma-27b-it"])
def test_a_null_window_means_full_attention_in_every_family_that_reads_one(tmp_path, name):
    """The rule lives in one place (megaft.models.arch.spec.window_field), not in Mistral's spec."""
    raw = {**_model_raw(name), "sliding_window": None}
    raw.pop("sliding_window_size", None)
    cfg = hf_model_config(_folder(tmp_path, raw))
    assert all(cfg.window(i) is None for i in range(cfg.n_layers))


def test_gemma2_window_size_must_agree_with_its_window(tmp_path):
    raw = {**_file("gemma-2-9b-it"), "sliding_window_size": 2048}
    with pytest.raises(HFCheckpointError, match="sliding_window_size=2048 differs from sliding_window=4096"):
        hf_model_config(_folder(tmp_path, raw))
