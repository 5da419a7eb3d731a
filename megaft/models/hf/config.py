"""A Hugging Face checkpoint's config.json read into a ModelConfig through its family's spec
(megaft.models.arch), without torch: megaft-plan and validation read architectures this way.
Its weights are megaft.models.hf.load's."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from megaft.config.model import ModelConfig
from megaft.models.arch import SPECS, spec_for
from megaft.models.arch.spec import HFCheckpointError, read_common, readable_quantized, screen

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# ModelConfig fields a family sets; one it does not set takes ModelConfig's default (Llama's dense block).
FAMILY_FIELDS = ("attention_bias", "mlp_bias", "qkv_bias", "qk_norm", "qk_norm_width", "sliding_window", "layer_types",
                 "norm_offset", "scale_embeddings", "sandwich_norms", "query_pre_attn_scalar", "rope_local",
                 "attn_softcap", "final_softcap", "n_experts", "top_k", "moe_ffn_dim", "norm_topk_prob",
                 "shared_expert_ffn_dim", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                 "router_z_loss_coef", "router_scoring", "n_group", "topk_group", "routed_scaling_factor",
                 "shared_expert_gate", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
                 "rope_interleave")  # names listed in an error before "... and N more"


def hf_name(name: str, arch: str = "llama") -> str:
    """Our parameter name -> its name in the HF *ForCausalLM state dict of family `arch`."""
    return SPECS[arch].hf_name(name)


def read_hf_config(path: str) -> dict[str, Any]:
    """The parsed PATH/config.json, with a clear error when missing or not JSON."""
    file = os.path.join(path, CONFIG)
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise HFCheckpointError(f"{file}: not found; fix: point model.init_from at an HF checkpoint "
                                f"directory (config.json + *.safetensors) of a supported model "
                                f"({', '.join(SPECS)})") from None
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{file}: cannot read it as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{file}: expected a JSON object, found {type(raw).__name__}")
    return raw


def hf_model_config(path: str, base: Optional[ModelConfig] = None) -> ModelConfig:
    """ModelConfig of the HF checkpoint in directory `path` (a supported model_type).

    Shape and architecture fields come from config.json through the family's spec
    (megaft.models.arch), which refuses what megaft cannot compute exactly; the rest
    (dropout, init, vocab padding) from `base` (default ModelConfig()). `max_seq_len` is
    max_position_embeddings, the model's own limit (the rotary tables cover it).
    bos/eos/pad ids and max_position_embeddings are kept in `extra` for export.
    """
    return model_config_of(read_hf_config(path), os.path.join(path, CONFIG), path, base)


def model_config_of(raw: dict[str, Any], file: str, path: str, base: Optional[ModelConfig] = None) -> ModelConfig:
    """`hf_model_config` of a parsed config.json `raw` (read from `file`, of the checkpoint in
    `path`): a multimodal checkpoint hands its completed text_config here."""
    base = base or ModelConfig()
    quant = raw.get("quantization_config") if readable_quantized(raw) else None
    raw = screen(raw, file, base.hf_ignore_keys)
    spec = spec_for(raw.get("model_type"), file)
    raw = spec.normalize(raw, file)
    family = spec.read(raw, file)
    common = read_common(raw, spec, file, base, act=family.pop("activation", None))
    # a family's own extra fields (DeepSeek-V3's num_nextn_predict_layers) join the common ones; a
    # readable quantized config (for planning) is marked, so check_model refuses to train it
    common["extra"] = {**common["extra"], **family.pop("extra", {}),
                       **({"quantization_config": quant} if quant is not None else {})}
    # The family's fields win over the common ones they refine; the Llama-only
    # defaults a family does not set fall back to ModelConfig's (Llama behaviour).
    fields = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
              for f in dataclasses.fields(ModelConfig) if f.name in FAMILY_FIELDS}
    return dataclasses.replace(base, name=os.path.basename(os.path.normpath(path)), init_from=str(path),
                               **{**fields, **common, **family})
