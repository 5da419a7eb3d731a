"""Read a Hugging Face checkpoint: config.json -> ModelConfig (through the family's
spec, megaft.models.arch), safetensors -> shards.

Each tp rank reads only its slice of every sharded tensor (`safe_open(...).get_slice`),
so a rank never holds a full copy of the model in memory.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

from megaft.models.arch import SPECS
from megaft.models.arch.spec import HFCheckpointError
from megaft.models.attention.kv_heads import local_rows
from megaft.models.hf.config import CONFIG, INDEX, SINGLE, hf_name, read_hf_config
from megaft.parallel.tensor.shard import expert_slice_of, full_shape, shard_of

_LIST_LIMIT = 20
log = logging.getLogger(__name__)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    return shown + (f" ... and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else "")


def checkpoint_files(path: str) -> dict[str, str]:
    """Every tensor name of the checkpoint in `path` -> the safetensors file holding it."""
    index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index}: cannot read its weight_map ({e!r})") from e
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise HFCheckpointError(f"{file}: listed in {index} but not found")
        return files
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    raise HFCheckpointError(f"{path}: no {SINGLE} or {INDEX}; fix: save the model with "
                            "safetensors (save_pretrained does by default)")


def _source(path: str) -> str:
    """The file that lists the checkpoint's tensors (for error messages)."""
    index = os.path.join(path, INDEX)
    return index if os.path.isfile(index) else os.path.join(path, SINGLE)


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor feeding (part of) a parameter: `expert`, the index along a
    stacked expert weight's dim 0 it fills (None: the whole parameter); `offset`, where the
    parameter's rows start along the sharded dim (the up half of a fused gate_up_proj)."""
    hf: str
    shape: tuple
    expert: Optional[int] = None
    offset: int = 0


def _sources(model: nn.Module, files: dict[str, str], tp_size: int) -> dict[str, list[Source]]:
    """Our parameter names -> the checkpoint tensors that fill them. Stacked expert weights
    read the published per-expert tensors, or transformers 5's fused in-memory ones
    (`mlp.experts.gate_up_proj` [E, 2F, dim], `mlp.experts.down_proj` [E, dim, F]) when the
    checkpoint holds those instead."""
    cfg = getattr(model, "cfg", None)
    arch = getattr(cfg, "arch", "llama")
    spec = SPECS[arch]
    out = {}
    for name, param in tensors(model):
        shape = full_shape(param, tp_size)
        per_expert = spec.expert_names(name, cfg.n_experts) if cfg is not None else None
        if per_expert is None:
            out[name] = [Source(hf_name(name, arch), shape)]
            continue
        prefix, _, proj = name.rpartition(".mlp.experts.")
        fused = f"model.{prefix}.mlp.experts." + ("down_proj" if proj == "down_proj" else "gate_up_proj")
        if per_expert[0] not in files and fused in files:
            if proj == "down_proj":
                out[name] = [Source(fused, shape)]
            else:  # gate rows first, then up rows
                e, f, d = shape
                out[name] = [Source(fused, (e, 2 * f, d), offset=f if proj == "up_proj" else 0)]
        else:  # this rank's experts only (all but under expert parallelism)
            split = expert_slice_of(param)
            lo, hi = split.bounds if split is not None else (0, len(per_expert))
            out[name] = [Source(hf, shape[1:], expert=i - lo) for i, hf in enumerate(per_expert) if lo <= i < hi]
    return out


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds (DeepSeek-V3's routing correction bias), by name; the
    non-persistent ones (RoPE tables) are derived, never saved."""
    out = []
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor an HF checkpoint fills: the parameters, then the persistent buffers."""
    return list(model.named_parameters()) + persistent_buffers(model)


def _read_into(f, src: Source, param: torch.Tensor, tp_rank: int, tp_size: int) -> None:
    """Copy this rank's rows of checkpoint tensor `src` into `param` (cast to its dtype),
    reading only those rows; padding rows become zero."""
    spec, split = shard_of(param), expert_slice_of(param)
    sl = f.get_slice(src.hf)
    dst = param if src.expert is None else param[src.expert]
    # a fused [E, ...] tensor into experts split over ep: this rank's experts only
    experts = slice(*split.bounds) if split is not None and src.expert is None else slice(None)
    if spec is None:
        dst.copy_(sl[experts])
        return
    dim = spec.dim - (src.expert is not None)
    start, end = spec.real_bounds(tp_rank, tp_size)
    if end > start:  # a rank may own only padding rows when the vocabulary is tiny
        index = ((experts,) + (slice(None),) * (dim - 1) if dim > 0 else ()) + (slice(src.offset + start,
                                                                                      src.offset + end),)
        dst.narrow(dim, 0, end - start).copy_(sl[index])
    dst.narrow(dim, end - start, dst.shape[dim] - (end - start)).zero_()


def _by_file(wanted: dict[str, list[Source]], files: dict[str, str]) -> list[tuple[str, list[tuple[str, Source]]]]:
    """(file, [(our param name, source)]) for the wanted tensors the checkpoint has."""
    by_file: dict[str, list[tuple[str, Source]]] = {}
    for name, sources in wanted.items():
        for src in sources:
            if src.hf in files:
                by_file.setdefault(files[src.hf], []).append((name, src))
    return sorted(by_file.items())


def _check_tp(model: nn.Module, tp_size: int) -> None:
    for name, param in model.named_parameters():
        spec = shard_of(param)
        if spec is not None and param.shape[spec.dim] != local_rows(spec, tp_size):
            raise ValueError(f"{name} has {param.shape[spec.dim]} rows per rank, not the "
                             f"{local_rows(spec, tp_size)} of tp_size={tp_size}: built for another tp")


def _other_experts(model: nn.Module, cfg) -> set[str]:
    """The per-expert tensors of the experts other ep ranks hold: in the file, not read here."""
    out = set()
    for name, param in model.named_parameters():
        if expert_slice_of(param) is not None:
            out.update(SPECS[cfg.arch].expert_names(name, cfg.n_experts) or ())
    return out


def _prediction_layers(files: dict[str, str], cfg) -> set[str]:
    """DeepSeek-V3's multi-token-prediction layers, `model.layers.{n_layers + i}.*` for i below
    num_nextn_predict_layers: megaft trains next-token prediction only, so they stay unread."""
    mtp = getattr(cfg, "extra", {}).get("num_nextn_predict_layers", 0) if cfg is not None else 0
    if not mtp:
        return set()
    layer = re.compile(r"model\.layers\.(\d+)\.")
    return {n for n in files if (m := layer.match(n)) and cfg.n_layers <= int(m.group(1)) < cfg.n_layers + mtp}


def _check(model: nn.Module, files: dict[str, str], path: str, tp_size: int,
           strict: bool) -> dict[str, list[Source]]:
    """Map our param names -> their checkpoint tensors after checking names and shapes; every problem at once."""
    cfg = getattr(model, "cfg", None)
    wanted = _sources(model, files, tp_size)
    tied = getattr(cfg, "tie_embeddings", False)
    score = getattr(cfg, "score_head", False)
    if score and "score.weight" not in files:  # a causal LM under a new reward head: build_model inits it
        wanted.pop("score.weight", None)
    problems = []
    needed = list(dict.fromkeys(src.hf for sources in wanted.values() for src in sources))
    missing = [hf for hf in needed if hf not in files]
    if missing:
        problems.append(f"{_source(path)}: tensors missing from the checkpoint: {_names(missing)}")
    # HF omits lm_head when tied, but some tied checkpoints still carry a copy: ignore it.
    # A reward model (score_head) has no LM head: a causal LM's is left behind.
    ignored = {"lm_head.weight"} if tied or score else set()
    known = set(needed) | ignored | _other_experts(model, cfg) | _prediction_layers(files, cfg)
    extra = sorted(n for n in files if n not in known and not n.endswith("rotary_emb.inv_freq"))
    if extra and strict:
        problems.append(f"{_source(path)}: unexpected tensors (not in the model; strict=False ignores them): "
                        f"{_names(extra)}")
    for file, entries in _by_file(wanted, files):
        with safe_open(file, "pt") as f:
            for src in {src.hf: src for _, src in entries}.values():  # a fused tensor feeds two params
                found = tuple(f.get_slice(src.hf).get_shape())
                if found != src.shape:
                    problems.append(f"{file}: tensor {src.hf} has shape {list(found)}, "
                                    f"expected {list(src.shape)} from config.json")
    if problems:
        raise HFCheckpointError("cannot load the HF checkpoint:\n  " + "\n  ".join(problems))
    return wanted


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str, *, tp_rank: int, tp_size: int, strict: bool = True) -> None:
    """Fill a built (tp-sharded) Decoder with the weights of the HF checkpoint in `path`.

    Reads model.safetensors or model.safetensors.index.json; each rank reads only the
    rows of its shard, zero-fills vocabulary padding and casts to the parameter's
    dtype. Every name and shape is checked before any parameter changes; `strict`
    also rejects checkpoint tensors the model lacks (rotary inv_freq buffers aside).
    """
    _check_tp(model, tp_size)
    files = checkpoint_files(path)
    _refuse_quantized(path, files)
    wanted = _check(model, files, path, tp_size, strict)
    skipped = _prediction_layers(files, getattr(model, "cfg", None))
    if skipped:
        log.warning("%s: skipped %d tensors of the %d multi-token-prediction layer(s) (model.layers.%d and up): "
                    "megaft trains next-token prediction only", path, len(skipped),
                    model.cfg.extra["num_nextn_predict_layers"], model.cfg.n_layers)
    by_name = dict(tensors(model))
    for file, entries in _by_file(wanted, files):
        with safe_open(file, "pt") as f:  # each file opened once
            for name, src in entries:
                _read_into(f, src, by_name[name], tp_rank, tp_size)


def _refuse_quantized(path: str, files: dict[str, str]) -> None:
    """Quantized weights (DeepSeek-V3/R1's FP8 blocks with their weight_scale_inv), whose config.json
    megaft reads for planning only: an error naming the fix."""
    scales = [n for n in files if n.endswith("weight_scale_inv")]
    quant = read_hf_config(path).get("quantization_config") if os.path.isfile(os.path.join(path, CONFIG)) else None
    if quant or scales:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "fp8"
        raise HFCheckpointError(
            f"{path}: the weights are quantized (quantization_config quant_method={method!r}"
            + (f", {len(scales)} weight_scale_inv tensors" if scales else "") + "); megaft trains full-precision "
            "weights; fix: dequantize the checkpoint to bf16 first (DeepSeek-V3/R1: DeepSeek's "
            "inference/fp8_cast_bf16.py) and point model.init_from at that copy")
