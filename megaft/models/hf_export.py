"""Write a tp-sharded Llama as a Hugging Face checkpoint directory.

Every tp rank takes part in gathering each parameter (one all-gather per sharded
tensor, a safetensors shard at a time, so peak memory is one shard); only the
writer rank touches the disk. The directory appears complete or not at all: it
is written under a temporary name beside `out_dir` and renamed at the end.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from megaft.layers.shard import full_shape, shard_of
from megaft.models.config import ModelConfig
from megaft.models.hf_load import CONFIG, INDEX, SINGLE, hf_name
from megaft.parallel.comm import Group, all_gather, group_size

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB" (decimal, like save_pretrained)
# Files a tokenizer.json usually travels with; copied when present beside it.
TOKENIZER_SIDECARS = ("tokenizer_config.json", "special_tokens_map.json")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json of `cfg` as a transformers LlamaConfig (loads in transformers 4 and 5)."""
    scaling = None
    if cfg.rope_scaling:
        scaling = {k: v for k, v in cfg.rope_scaling.items() if k != "type"}
        scaling["rope_type"] = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    rope = {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    extra = cfg.extra
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.hd,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": extra.get("max_position_embeddings", cfg.max_seq_len),
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": cfg.mlp_bias,
        "rope_parameters": rope,  # transformers 5
        "rope_theta": cfg.rope_theta,  # transformers 4 and tools that follow it (vLLM, llama.cpp)
        "rope_scaling": scaling,
        "bos_token_id": extra.get("bos_token_id"),
        "eos_token_id": extra.get("eos_token_id"),
        "pad_token_id": extra.get("pad_token_id"),
        "dtype": _dtype_name(dtype),  # transformers 5 name
        "torch_dtype": _dtype_name(dtype),  # transformers 4 name
        "use_cache": True,
    }


def _plan(params: list[tuple[str, nn.Parameter]], tp_size: int, dtype: Optional[torch.dtype],
          max_bytes: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Group params into files of at most `max_bytes` (a bigger tensor gets its own),
    in model order; every rank computes the same plan from shapes alone."""
    shards: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for name, p in params:
        nbytes = math.prod(full_shape(p, tp_size)) * (dtype or p.dtype).itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, p))
        size += nbytes
    return shards


def _full(param: torch.Tensor, group: Group) -> torch.Tensor:
    """The unsharded tensor of `param`: all-gathered along its shard dim, padding cropped."""
    spec = shard_of(param)
    local = param.detach()
    if spec is None:
        return local
    full = all_gather(local, spec.dim, group)
    if full.shape[spec.dim] != spec.padded:
        raise ValueError(f"tp group of {group_size(group)} ranks gathered {full.shape[spec.dim]} rows, "
                         f"the parameter was sharded for {spec.padded}: pass the model's own tp group")
    return full.narrow(spec.dim, 0, spec.full)


def _publish(tmp: str, out_dir: str) -> None:
    """Rename the finished `tmp` to `out_dir`, replacing an older export there."""
    old = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "x"))
    os.rename(tmp, out_dir)
    if old:
        shutil.rmtree(old)


def _copy_tokenizer(tokenizer_json: str, tmp: str) -> None:
    src = os.path.join(tokenizer_json, "tokenizer.json") if os.path.isdir(tokenizer_json) else tokenizer_json
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: tokenizer.json to export not found")
    shutil.copyfile(src, os.path.join(tmp, "tokenizer.json"))
    for name in TOKENIZER_SIDECARS:
        side = os.path.join(os.path.dirname(src), name)
        if os.path.isfile(side):
            shutil.copyfile(side, os.path.join(tmp, name))


@torch.no_grad()
def export_hf(model: nn.Module, cfg: ModelConfig, out_dir: str, *, tokenizer_json: Optional[str],
              tp_group: Group, is_writer: bool, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              dtype: Optional[torch.dtype] = None) -> str:
    """Write `model` (tp-sharded over `tp_group`) as an HF Llama checkpoint in `out_dir`.

    Collective: every rank of `tp_group` must call it. The writer rank writes
    config.json, model.safetensors (or model-0000i-of-0000n.safetensors and
    model.safetensors.index.json when the weights exceed `max_shard_bytes`) and a
    copy of `tokenizer_json` (a file or a directory holding tokenizer.json); an
    existing `out_dir` is replaced. `dtype` casts the weights (default: as trained).
    Returns `out_dir` once the writer has finished (the tp group waits for it).
    """
    out_dir = os.path.abspath(out_dir)
    params = list(model.named_parameters())
    tp_size = group_size(tp_group)
    shards = _plan(params, tp_size, dtype, max_shard_bytes)
    tmp = None
    if is_writer:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
    try:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, p in shard:
                full = _full(p, tp_group)  # collective: every rank gathers, the writer keeps it
                if is_writer:
                    tensors[hf_name(name)] = full.to("cpu", dtype or full.dtype).contiguous()
            if is_writer:
                save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, file))
                total += sum(t.numel() * t.element_size() for t in tensors.values())
        if is_writer:
            with open(os.path.join(tmp, CONFIG), "w") as f:
                json.dump(hf_config_dict(cfg, dtype or params[0][1].dtype), f, indent=2)
            if len(shards) > 1:
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            if tokenizer_json:
                _copy_tokenizer(tokenizer_json, tmp)
            _publish(tmp, out_dir)
    except BaseException:
        if tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if tp_size > 1:
        dist.barrier(group=tp_group)  # the directory exists for every tp rank on return
    return out_dir
