"""One test per refusal: unsupported architectures, config.json fields megaft cannot
honour exactly, model configs check_model rejects, and exports a family cannot express.
Each asserts the message names the cause (and the supported alternatives)."""
from __future__ import annotations

import json
import os

import pytest

from megaft.config.model import ModelConfig
from megaft.models.checks import check_model
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.export import hf_config_dict
from megaft.models.hf.load import HFCheckpointError
from models.arch_fixture import hf_config

SUPPORTED = ("megaft imports llama, qwen2, qwen3, mistral, gemma, gemma2, gemma3_text, mixtral, qwen2_moe, qwen3_moe, "
             "olmoe, deepseek_v3 checkpoints")


def _write(tmp_path, raw: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def _raw(name: str = "llama3") -> dict:
    return hf_config(name).to_dict()


def _refused(tmp_path, raw: dict, match: str) -> str:
    with pytest.raises(HFCheckpointError) as info:
        hf_model_config(_write(tmp_path, raw))
    message = str(info.value)
    assert f"{tmp_path}/config.json: " in message and match in message, message
    return message


@pytest.mark.parametrize("model_type", ["gpt2", "deepseek_v2", "phimoe", "gemma3", "recurrent_gemma", None])
def test_unsupported_model_type(tmp_path, model_type):
    _refused(tmp_path, {**_raw(), "model_type": model_type}, f"model_type {model_type!r} is not supported; "
             + SUPPORTED)


def test_unknown_field_that_may_change_the_math(tmp_path):
    # e.g. a mixture-of-experts field under a llama model_type
    _refused(tmp_path, {**_raw(), "num_local_experts": 8, "final_logit_softcapping": 30.0},
             "config.json fields ['final_logit_softcapping', 'num_local_experts'] are not understood by megaft's "
             "llama spec and may change the model's math")


def test_family_field_outside_its_family(tmp_path):
    # qk-norm models say so by model_type; Qwen2's window fields are not Llama's
    _refused(tmp_path, {**_raw(), "use_sliding_window": True}, "fields ['use_sliding_window'] are not understood")


@pytest.mark.parametrize("field,value", [("attention_dropout", 0.1), ("use_mrope", True), ("rope_interleaved", True)])
def test_non_neutral_value(tmp_path, field, value):
    message = _refused(tmp_path, {**_raw(), field: value}, f"{field}={value!r} is not supported")
    assert f"model.hf_ignore_keys=[{field}]" in message


@pytest.mark.parametrize("quant", [{"quant_method": "bitsandbytes", "load_in_4bit": True},
                                   {"quant_method": "gptq", "bits": 4}, {"quant_method": "awq", "bits": 4},
                                   {"quant_method": "fp8", "activation_scheme": "dynamic"}])
def test_quantized_checkpoint_has_its_own_message(tmp_path, quant):
    # refused before the family reads anything, and model.hf_ignore_keys cannot wave it through
    message = _refused(tmp_path, {**_raw(), "quantization_config": quant},
                       f"the checkpoint is quantized (quantization_config quant_method={quant['quant_method']!r})")
    assert "unquantized (bf16/fp32) checkpoint" in message
    with pytest.raises(HFCheckpointError, match="is quantized"):
        hf_model_config(str(tmp_path), base=ModelConfig(hf_ignore_keys=["quantization_config"]))


def test_metadata_keys_are_never_refused(tmp_path):
    # What SmolLM2-135M-Instruct's published config.json and its save_pretrained copy carry
    # beside the Llama fields: none of it reaches the math.
    metadata = {"_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "unk_token_id": 0,
                "is_llama_config": True, "rope_interleaved": False,
                "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}},
                "_attn_implementation_autoset": True, "image_token_id": 5, "suppress_token_ids": [1]}
    plain = hf_model_config(_write(tmp_path, _raw()))
    assert hf_model_config(_write(tmp_path, {**_raw(), **metadata})) == plain


def test_hf_ignore_keys_is_the_way_out_for_a_user_who_knows(tmp_path):
    raw = {**_raw(), "my_lab_flag": 3, "attention_dropout": 0.1}
    message = _refused(tmp_path, raw, "fields ['my_lab_flag'] are not understood")
    assert "model.hf_ignore_keys=[my_lab_flag]" in message
    ignored = hf_model_config(str(tmp_path), base=ModelConfig(hf_ignore_keys=["my_lab_flag", "attention_dropout"]))
    assert ignored.dim == hf_model_config(_write(tmp_path, _raw())).dim and ignored.hf_ignore_keys == [
        "my_lab_flag", "attention_dropout"]


def test_gemma_bidirectional_attention(tmp_path):
    _refused(tmp_path, {**_raw("gemma"), "use_bidirectional_attention": True},
             "use_bidirectional_attention=True is not supported")


def test_soft_capping_with_cp_or_the_fused_loss_is_refused_before_launch(tmp_path):
    """Gemma 2's caps: the ring (cp) and the fused linear cross-entropy have none."""
    from megaft.config import Config
    from megaft.validation import validate
    from models.arch_fixture import make_hf

    make_hf(str(tmp_path / "ckpt"), "gemma2")
    cfg = Config()
    cfg.model.init_from, cfg.data.seq_len, cfg.launcher.nproc = str(tmp_path / "ckpt"), 16, 2
    cfg.parallel.tp, cfg.parallel.cp = 1, 2
    cfg.kernels.fused_linear_cross_entropy = True
    problems = validate(cfg, 2)
    assert any("parallel.cp=2 with soft-capped attention (model.attn_softcap=1.0, Gemma 2) is not supported" in p
               and "fix: parallel.cp=1" in p for p in problems), problems
    assert any("model.final_softcap=2.0 caps; fix: kernels.fused_linear_cross_entropy=false" in p
               for p in problems), problems
    cfg.parallel.cp, cfg.kernels.fused_linear_cross_entropy, cfg.parallel.tp = 1, False, 2
    assert validate(cfg, 2) == []


def test_gemma3_transformers4_config_reads_like_transformers5(tmp_path):
    """rope_theta / rope_local_base_freq / sliding_window_pattern (transformers 4) give the
    same model as rope_parameters per layer type and layer_types (transformers 5)."""
    raw = _raw("gemma3")
    new = hf_model_config(_write(tmp_path, raw))
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=1e4,
               sliding_window_pattern=2)
    (tmp_path / "v4").mkdir()
    got = hf_model_config(_write(tmp_path / "v4", old))
    for f in ("rope_theta", "rope_scaling", "rope_local", "layer_types", "sliding_window", "query_pre_attn_scalar",
              "sandwich_norms", "qk_norm"):
        assert getattr(got, f) == getattr(new, f), f
    assert new.rope_local == {"rope_theta": 1e4} and new.layer_types == ["sliding_attention", "full_attention"]


def test_activation(tmp_path):
    _refused(tmp_path, {**_raw(), "hidden_act": "relu"}, "hidden_act 'relu' is not supported")


def test_rope_type(tmp_path):
    _refused(tmp_path, {**_raw(), "rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}},
             "rope type 'longrope' is not supported (megaft computes default, linear, dynamic, llama3, yarn")


def test_partial_rotary_factor(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    _refused(tmp_path, {**_raw(), "rope_parameters": rope}, "partial_rotary_factor=0.5 is not supported")


def test_unknown_rope_parameter(tmp_path):
    rope = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "mrope_section": [8, 8]}
    _refused(tmp_path, {**_raw(), "rope_parameters": rope},
             "rope parameters ['mrope_section'] are not understood for rope type 'linear'")


def test_missing_shape_field(tmp_path):
    raw = _raw()
    del raw["hidden_size"]
    _refused(tmp_path, raw, "missing hidden_size")


def test_sliding_layers_without_window(tmp_path):
    raw = {**_raw("qwen2"), "use_sliding_window": False, "layer_types": ["sliding_attention"] * 2}
    _refused(tmp_path, raw, "layer_types has sliding_attention layers but no sliding_window is in use")


def test_max_position_embeddings_sets_max_seq_len(tmp_path):
    raw = {**_raw("mistral"), "max_position_embeddings": 40}
    assert hf_model_config(_write(tmp_path, raw), base=ModelConfig(max_seq_len=256)).max_seq_len == 40


def _problems(**fields) -> list[str]:
    return check_model(ModelConfig(vocab_size=10, **fields), 1)


def test_check_model_dynamic_rope_past_max_position_embeddings():
    cfg = ModelConfig(vocab_size=10, max_seq_len=128, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                      extra={"max_position_embeddings": 64})
    assert any("exceeds max_position_embeddings=64 under dynamic rope scaling" in p for p in check_model(cfg, 1))


def test_check_model_unknown_arch_and_activation():
    problems = _problems(arch="gpt2", activation="relu")
    supported = "llama, qwen2, qwen3, mistral, gemma, gemma2, gemma3_text"
    assert any(f"model.arch='gpt2' is not supported; fix: one of {supported}" in p for p in problems), problems
    assert any("model.activation='relu' is not supported" in p for p in problems), problems


def test_check_model_feature_the_family_cannot_export():
    problems = _problems(sliding_window=8)
    assert problems == ["model.sliding_window=8 cannot be exported as llama (LlamaForCausalLM has "
                        "sliding_window=None); fix: set model.arch to a family that has it"]
    assert _problems(arch="mistral", sliding_window=8) == []


def test_check_model_layer_types():
    problems = _problems(arch="qwen2", qkv_bias=True, sliding_window=4, n_layers=2,
                         layer_types=["full_attention", "local"])
    assert any("model.layer_types ['local'] not supported" in p for p in problems), problems
    assert any("model.layer_types has 2 entries" in p for p in _problems(
        arch="qwen2", qkv_bias=True, sliding_window=4, n_layers=3, layer_types=["full_attention"] * 2))


def test_check_model_tp_and_kv_heads():
    """tp may divide n_kv_heads or be a multiple of it (kv heads replicated), nothing in between."""
    cfg = ModelConfig(vocab_size=10, n_heads=12, n_kv_heads=4, dim=96, ffn_dim=96)
    assert check_model(cfg, 2) == [] and check_model(cfg, 12) == []  # split; 3 copies of each kv head
    assert check_model(cfg, 6) == ["parallel.tp=6 neither divides nor is a multiple of model.n_kv_heads=4; "
                                   "fix: a divisor or a multiple of 4"]


def test_export_refuses_what_the_family_cannot_express():
    cfg = ModelConfig(vocab_size=10, qk_norm=True)  # arch llama: LlamaForCausalLM has no qk-norm
    with pytest.raises(ValueError, match="cannot export: model.qk_norm=True cannot be exported as llama"):
        hf_config_dict(cfg)


def test_validate_reports_unsupported_architecture_before_launch(tmp_path):
    """megaft.config.validate (run before any rank or job) carries the refusal."""
    from megaft.config import Config
    from megaft.validation import validate
    from models.hf_fixture import make_hf_llama

    make_hf_llama(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "deepseek_v2"}))
    cfg = Config()
    cfg.model.init_from = str(tmp_path)
    problems = validate(cfg, 1)
    assert any(f"{os.path.join(str(tmp_path), 'config.json')}: model_type 'deepseek_v2' is not supported; "
               + SUPPORTED in p for p in problems), problems


def test_check_model_sigmoid_router_with_an_aux_coefficient():
    moe = dict(arch="deepseek_v3", n_experts=4, top_k=2, router_scoring="sigmoid")
    problems = _problems(**moe, router_aux_loss_coef=0.01)
    assert any("model.router_scoring=sigmoid with model.router_aux_loss_coef=0.01" in p
               and "fix: model.router_aux_loss_coef=0" in p and "model.router_scoring=softmax" in p
               for p in problems), problems
    assert not any("router_aux_loss_coef" in p for p in _problems(**moe, router_aux_loss_coef=0.0))
    assert not any("router_aux_loss_coef" in p for p in _problems(**{**moe, "router_scoring": "softmax"},
                                                                  router_aux_loss_coef=0.01))
