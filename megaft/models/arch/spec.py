"""ArchSpec: what one architecture family changes in the Llama block, its HF names and
the config.json fields it reads and writes.

`read_common` maps the fields every family shares (shapes, RoPE, norm epsilon, tied
embeddings, the activation, max_position_embeddings) and refuses what megaft cannot
compute exactly; a family's `read` adds its own fields. Every key of config.json must
be read by the family, be metadata (GENERIC, or by its form: `is_metadata`) or carry its
neutral value (NEUTRAL): anything else might change the math, so it is an error naming
the key and the way out (`model.hf_ignore_keys`). A quantized checkpoint is refused
with its own message (`screen`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from megaft.config.model import ROPE_TYPES, ModelConfig


class HFCheckpointError(ValueError):
    """An HF checkpoint is unusable; the message names the file and tensor."""


class HFConfigError(HFCheckpointError):
    """config.json describes a model megaft cannot run exactly; the message names why."""


# Metadata and generation defaults (PretrainedConfig's, transformers 4 and 5): no effect on the logits.
GENERIC = frozenset((
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "id2label", "label2id", "num_labels", "output_attentions", "output_hidden_states",
    "return_dict",
    "problem_type", "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "chunk_size_feed_forward", "tokenizer_class", "torchscript", "tie_encoder_decoder", "prefix",
    "task_specific_params", "finetuning_task", "use_bfloat16", "tf_legacy_loss", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "pretraining_tp",  # Llama 2's sliced matmuls: transformers 5 no longer reads it (same math)
    "cache_implementation",  # generation's KV cache kind (Gemma 2/3 write "hybrid")
    # a release label no transformers class reads ("7b-alpha-v2.33.0.30" in humain-ai/ALLaM-7B-Instruct-preview's
    # config.json, tests/models/real_configs/allam-7b-instruct-preview.json)
    "internal_version",
))
# Families whose *ForSequenceClassification is not the *ForCausalLM name with the suffix changed
# (transformers' MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES), None: transformers has none.
SCORE_ARCHITECTURES = {"gemma3_text": "Gemma3TextForSequenceClassification", "olmoe": None}
# Fields megaft accepts only at the value that leaves the math as megaft computes it.
NEUTRAL = {"attention_dropout": (0, 0.0, None), "pruned_heads": ({}, None), "use_mrope": (False, None),
           "use_bidirectional_attention": (False, None),
           "rope_interleaved": (False, None)}  # GPT-J's interleaved pairs; megaft rotates halves, as Llama
COMMON = frozenset(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                    "rope_scaling", "rope_parameters", "tie_word_embeddings", "hidden_act"))
# HF config fields kept in ModelConfig.extra so that export writes them back.
EXTRA_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
# Keys of rope_parameters (besides rope_type / rope_theta) each rope_type reads.
ROPE_KEYS = {"default": (), "linear": ("factor",), "dynamic": ("factor", "original_max_position_embeddings"),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                      "mscale", "mscale_all_dim", "truncate")}
# Our stacked expert weights (megaft.models.moe.layer.Experts), in the order of ArchSpec.expert_proj.
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ACT_ALIASES = {"gelu_pytorch_tanh": "gelu_pytorch_tanh", "gelu_tanh": "gelu_pytorch_tanh", "silu": "silu",
               "swish": "silu"}


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # HF model_type, also ModelConfig.arch
    architecture: str  # the *ForCausalLM class written to config.json "architectures"
    differs: str  # what differs from the Llama block, one line (README, error messages)
    fields: frozenset  # config.json fields the family reads beyond COMMON
    defaults: dict  # transformers' values of fields config.json may omit
    read: Callable[[dict, str], dict]  # (config.json, file) -> the family's ModelConfig fields
    write: Callable[[ModelConfig], dict]  # ModelConfig -> the family's config.json fields
    refuse: Callable[[ModelConfig], list[str]] = lambda cfg: []  # what this family's HF class cannot express
    # config.json as read_common expects it (a family with its own rope layout rewrites it first)
    normalize: Callable[[dict, str], dict] = lambda raw, file: raw

    moe: bool = False  # a mixture-of-experts family (ModelConfig.n_experts > 0); dense families have none
    # Mixtures of experts: the HF module holding the router and the experts (Mixtral: block_sparse_moe),
    # and the per-expert names of our gate/up/down projections (Mixtral: w1, w3, w2)
    moe_module: str = "mlp"
    expert_proj: tuple = EXPERT_PROJ

    def score_architecture(self) -> Optional[str]:
        """The transformers *ForSequenceClassification class of this family (a reward model's export:
        the decoder under `model.`, a `score` head); None where transformers has none (OLMoE)."""
        return SCORE_ARCHITECTURES.get(self.model_type, self.architecture.replace("ForCausalLM",
                                                                                  "ForSequenceClassification"))

    def hf_name(self, name: str) -> str:
        """Our parameter name -> its HF *ForCausalLM state-dict name (every family shares
        Llama's layout: a `model.` prefix, lm_head at the top; a MoE router sits in
        `moe_module`). Stacked expert weights map to several tensors: `expert_names`."""
        if name in ("lm_head.weight", "score.weight"):  # *ForSequenceClassification's head: `score`
            return name
        if self.moe_module != "mlp":
            name = name.replace(".mlp.gate.", f".{self.moe_module}.gate.")
        return "model." + name

    def expert_names(self, name: str, n_experts: int) -> Optional[list[str]]:
        """The published per-expert tensors of a stacked expert weight (`layers.N.mlp.experts.gate_proj`
        [E, F, dim] -> `model.layers.N.mlp.experts.E.gate_proj.weight`, ...); None for other names."""
        prefix, sep, proj = name.rpartition(".mlp.experts.")
        if not sep or proj not in EXPERT_PROJ:
            return None
        hf_proj = self.expert_proj[EXPERT_PROJ.index(proj)]
        return [f"model.{prefix}.{self.moe_module}.experts.{e}.{hf_proj}.weight" for e in range(n_experts)]


def is_metadata(key: str) -> bool:
    """Keys that never reach the math by their form: private ones (`_name_or_path`,
    `_model_name_or_path`), token ids (`unk_token_id`, ...), tools' namespaced blocks
    (`transformers.js_config`) and conversion flags (`is_llama_config`)."""
    return (key.startswith("_") or key.endswith(("_token_id", "_token_ids")) or "." in key
            or (key.startswith("is_") and key.endswith("_config")))


def screen(raw: dict, file: str, ignore: Sequence[str] = ()) -> dict:
    """config.json without the keys the user declared harmless (model.hf_ignore_keys);
    a quantized checkpoint is refused here, before any family reads its shapes."""
    quant = raw.get("quantization_config")
    if readable_quantized(raw):  # kept for planning; check_model and the weight loader refuse it
        return {k: v for k, v in raw.items() if k not in set(ignore) and k != "quantization_config"}
    if quant is not None:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise HFConfigError(
            f"{file}: the checkpoint is quantized (quantization_config quant_method={method!r}); megaft trains "
            "full-precision weights and cannot read bitsandbytes, GPTQ, AWQ or FP8 tensors; fix: point "
            "model.init_from at the unquantized (bf16/fp32) checkpoint it was made from")
    return {k: v for k, v in raw.items() if k not in set(ignore)}


def readable_quantized(raw: dict) -> bool:
    """DeepSeek-V3/R1's FP8 release: block-quantized weights (weight_scale_inv beside each) of the
    shapes config.json describes, so the config is read for planning (megaft-plan, the
    performance model) while training and weight loading refuse it."""
    quant = raw.get("quantization_config")
    return (raw.get("model_type") == "deepseek_v3" and isinstance(quant, dict)
            and quant.get("quant_method") == "fp8")


def get(raw: dict, spec: ArchSpec, key: str) -> Any:
    """raw[key], transformers' default when config.json omits it (or writes null for a default)."""
    value = raw.get(key)
    return spec.defaults.get(key) if value is None else value


def activation(raw: dict, spec: ArchSpec, file: str, key: str = "hidden_act") -> str:
    act = get(raw, spec, key) or "silu"
    if act not in ACT_ALIASES:
        raise HFConfigError(f"{file}: {key} {act!r} is not supported (megaft runs {', '.join(sorted(ACT_ALIASES))})")
    return ACT_ALIASES[act]


def rope_fields(raw: dict[str, Any], file: str) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, scaling) from transformers 5's `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling` (whose type key may be "type")."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            params["rope_theta"] = raw["rope_theta"]
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", 10000.0))
    if kind not in ROPE_TYPES:
        raise HFConfigError(f"{file}: rope type {kind!r} is not supported (megaft computes {', '.join(ROPE_TYPES)} "
                            "exactly as transformers does)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConfigError(f"{file}: partial_rotary_factor={params['partial_rotary_factor']} is not supported "
                            "(megaft rotates the whole head dim)")
    params.pop("partial_rotary_factor", None)
    unknown = sorted(set(params) - set(ROPE_KEYS[kind]))
    if unknown:
        raise HFConfigError(f"{file}: rope parameters {unknown} are not understood for rope type {kind!r} "
                            f"(megaft reads {', '.join(ROPE_KEYS[kind]) or 'only rope_theta'})")
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **params}


def read_common(raw: dict, spec: ArchSpec, file: str, base: ModelConfig, act: Optional[str] = None
                ) -> dict[str, Any]:
    """ModelConfig fields every family reads the same way; refuses unknown fields.
    `act`: the activation when the family reads it itself (Gemma)."""
    unknown = sorted(k for k in raw if k not in GENERIC and k not in NEUTRAL and k not in COMMON
                     and k not in spec.fields and not is_metadata(k))
    if unknown:
        raise HFConfigError(f"{file}: config.json fields {unknown} are not understood by megaft's "
                            f"{spec.model_type} spec and may change the model's math; fix: use a supported "
                            "checkpoint, or, if you know they have no effect, model.hf_ignore_keys="
                            f"[{','.join(unknown)}]")
    for key, ok in NEUTRAL.items():
        if key in raw and raw[key] not in ok:
            raise HFConfigError(f"{file}: {key}={raw[key]!r} is not supported (megaft needs "
                                f"{' or '.join(repr(v) for v in ok)}); fix: a checkpoint without it, or "
                                f"model.hf_ignore_keys=[{key}] if you know it has no effect")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in raw]
    if missing:
        raise HFConfigError(f"{file}: missing {', '.join(missing)}")
    theta, scaling = rope_fields(raw, file)
    n_heads = raw["num_attention_heads"]
    max_pos = get(raw, spec, "max_position_embeddings") or base.max_seq_len
    return dict(
        arch=spec.model_type, dim=raw["hidden_size"], n_layers=raw["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=get(raw, spec, "head_dim") or raw["hidden_size"] // n_heads,
        ffn_dim=raw["intermediate_size"], vocab_size=raw["vocab_size"],
        norm_eps=float(get(raw, spec, "rms_norm_eps") or 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=int(max_pos), tie_embeddings=bool(get(raw, spec, "tie_word_embeddings") or False),
        activation=act or activation(raw, spec, file),
        extra={**base.extra, **{k: raw[k] for k in EXTRA_KEYS if k in raw}},
    )


def write_common(cfg: ModelConfig, spec: ArchSpec) -> dict[str, Any]:
    """The config.json fields every family writes (rope both ways: transformers 4 and 5)."""
    scaling = None
    if cfg.rope_scaling:
        scaling = {k: v for k, v in cfg.rope_scaling.items() if k != "type"}
        scaling["rope_type"] = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    extra = cfg.extra
    return {
        "architectures": [spec.architecture], "model_type": spec.model_type, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.hd, "intermediate_size": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
        "hidden_act": cfg.activation, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": extra.get("max_position_embeddings", cfg.max_seq_len),
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},  # transformers 5
        "rope_theta": cfg.rope_theta,  # transformers 4 and tools that follow it (vLLM, llama.cpp)
        "rope_scaling": scaling,
        "bos_token_id": extra.get("bos_token_id"), "eos_token_id": extra.get("eos_token_id"),
        "pad_token_id": extra.get("pad_token_id"), "use_cache": True,
    }


# ModelConfig fields only Gemma 2/3 set: every other family refuses them at other values.
NO_GEMMA23 = dict(sandwich_norms=False, query_pre_attn_scalar=None, rope_local=None, attn_softcap=None,
                  final_softcap=None)


def window_field(raw: dict, spec: ArchSpec) -> Optional[int]:
    """config.json's sliding_window: the family's default when omitted, None (no window) when
    null. Unlike `get`, null is a value here: transformers reads it as full attention
    (Mistral v0.2 and later, Qwen3, Gemma configs write it)."""
    window = raw.get("sliding_window", spec.defaults.get("sliding_window"))
    return None if window is None else int(window)


def refuse_unless(cfg: ModelConfig, spec: ArchSpec, **expected: Any) -> list[str]:
    """Problems for ModelConfig fields this family's HF class fixes at other values."""
    return [f"model.{k}={getattr(cfg, k)!r} cannot be exported as {spec.model_type} ({spec.architecture} "
            f"has {k}={v!r})" for k, v in expected.items()
            if not (getattr(cfg, k) == v or (isinstance(v, float) and math.isclose(getattr(cfg, k), v)))]


def sliding_layers(raw: dict, spec: ArchSpec, file: str) -> dict[str, Any]:
    """Qwen2/Qwen3 windows: `layer_types` when written (transformers 5), else layers
    >= max_window_layers slide when use_sliding_window (Qwen2Config.__post_init__)."""
    window = window_field(raw, spec) if get(raw, spec, "use_sliding_window") else None
    types = raw.get("layer_types")
    if types is None:
        start = get(raw, spec, "max_window_layers")
        types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                 for i in range(raw["num_hidden_layers"])]
    if "sliding_attention" in types and window is None:
        raise HFConfigError(f"{file}: layer_types has sliding_attention layers but no sliding_window is in use")
    if window is None or "sliding_attention" not in types:
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=int(window), layer_types=list(types))


def write_sliding_layers(cfg: ModelConfig) -> dict[str, Any]:
    types = [("sliding_attention" if cfg.window(i) is not None else "full_attention") for i in range(cfg.n_layers)]
    first = next((i for i, t in enumerate(types) if t == "sliding_attention"), cfg.n_layers)
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": first, "layer_types": types}
