"""Write a tp-sharded model as a Hugging Face checkpoint directory of its own family
(ModelConfig.arch: config.json from the family's spec in megaft.models.arch).

Every tp rank takes part in gathering each parameter (one all-gather per sharded
tensor, a safetensors shard at a time, so peak memory is one shard); only the
writer rank touches the disk. The directory appears complete or not at all: it
is written under a temporary name beside `out_dir` and renamed at the end.

Under pipeline parallelism each pp stage's writer (its tp_rank 0) writes its own
tensors into its own safetensors files of the sharded layout, so no rank ever holds
the whole model; the first stage's writer adds config.json, the index and the
tokenizer. That needs `out_dir`'s parent on a file system every pp rank sees (a
Slurm run directory is). The tied embedding's copy on the last stage is not written.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from megaft.config.model import ModelConfig
from megaft.models.arch import spec_for
from megaft.models.arch.spec import write_common
from megaft.models.attention.kv_heads import ReplicatedShard, dedupe_gathered
from megaft.models.hf.config import CONFIG, INDEX, SINGLE
from megaft.models.hf.load import tensors as model_tensors
from megaft.parallel.comm import Group, all_gather, group_rank, group_size
from megaft.parallel.tensor.shard import expert_slice_of, full_shape, shard_of

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB" (decimal, like save_pretrained)
# Files a tokenizer.json usually travels with; copied when present beside it.
# Copied from beside tokenizer.json when present: what transformers' save_pretrained of the
# tokenizer and model leaves there (a chat template may live in chat_template.jinja alone).
TOKENIZER_SIDECARS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "tokenizer.model",
                      "generation_config.json")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json of `cfg` for its family's transformers class (loads in transformers 4 and 5).
    Raises ValueError when the family's HF class cannot express `cfg` (check_model
    reports the same before launch)."""
    spec = spec_for(cfg.arch, "model.arch")
    problems = spec.refuse(cfg)
    if problems:
        raise ValueError("cannot export: " + "; ".join(problems))
    out = {**write_common(cfg, spec), **spec.write(cfg),
           "dtype": _dtype_name(dtype),  # transformers 5 name
           "torch_dtype": _dtype_name(dtype)}  # transformers 4 name
    if cfg.score_head:  # a reward model: *ForSequenceClassification reads one label at the last non-pad token
        if spec.score_architecture() is None:
            raise ValueError(f"cannot export: transformers has no sequence classification class for model.arch="
                             f"{cfg.arch}")
        out.update(architectures=[spec.score_architecture()], num_labels=1)
    return out


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


def _full(param: torch.Tensor, group: Group, local: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The unsharded tensor of `param` (or of `local`, a tensor shaped and split like it):
    all-gathered along its shard dim, padding cropped; routed experts split over ep then
    gathered over their ep group too (every rank of it must call)."""
    experts = expert_slice_of(param)
    local = param.detach() if local is None else local
    if experts is not None:
        return all_gather(_full_tp(param, group, local), 0, experts.group)
    return _full_tp(param, group, local)


def _full_tp(param: torch.Tensor, group: Group, local: torch.Tensor) -> torch.Tensor:
    spec = shard_of(param)
    if spec is None:
        return local
    full = all_gather(local, spec.dim, group)
    if isinstance(spec, ReplicatedShard):  # kv heads copied over tp > n_kv_heads: write each once
        return dedupe_gathered(full, spec, group_size(group))
    if full.shape[spec.dim] != spec.padded:
        raise ValueError(f"tp group of {group_size(group)} ranks gathered {full.shape[spec.dim]} rows, "
                         f"the parameter was sharded for {spec.padded}: pass the model's own tp group")
    return full.narrow(spec.dim, 0, spec.full)


def hf_tensors(name: str, full: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of our parameter `name` (its full value): one, or a stacked
    expert weight's published per-expert tensors."""
    spec = spec_for(cfg.arch, "model.arch")
    per_expert = spec.expert_names(name, cfg.n_experts)
    if per_expert is None:
        return {spec.hf_name(name): full.contiguous()}
    return {hf: full[e].contiguous() for e, hf in enumerate(per_expert)}


gather_full = _full  # the public name (megaft.peft.export gathers adapters with it)


def _publish(tmp: str, out_dir: str) -> None:
    """Rename the finished `tmp` to `out_dir`, replacing an older export there."""
    old = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "x"))
    os.rename(tmp, out_dir)
    if old:
        shutil.rmtree(old)


def copy_tokenizer(tokenizer_json: str, tmp: str) -> None:
    """tokenizer_json (a file, or a directory holding tokenizer.json) and its sidecars into `tmp`."""
    src = os.path.join(tokenizer_json, "tokenizer.json") if os.path.isdir(tokenizer_json) else tokenizer_json
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: tokenizer.json to export not found")
    copy_tokenizer_files(os.path.dirname(src), tmp)


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> None:
    """tokenizer.json and the files that travel with it (TOKENIZER_SIDECARS), those present."""
    for name in ("tokenizer.json",) + TOKENIZER_SIDECARS:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))


@torch.no_grad()
def export_hf(model: nn.Module, cfg: ModelConfig, out_dir: str, *, tokenizer_json: Optional[str],
              tp_group: Group, is_writer: bool, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              dtype: Optional[torch.dtype] = None, pp_group: Group = None,
              skip: Optional[Callable[[str], bool]] = None,
              transform: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None) -> str:
    """Write `model` (tp-sharded over `tp_group`) as an HF checkpoint of family `cfg.arch` in `out_dir`.

    Collective: every rank of `tp_group` must call it. The writer rank writes
    config.json, model.safetensors (or model-0000i-of-0000n.safetensors and
    model.safetensors.index.json when the weights exceed `max_shard_bytes`) and a
    copy of `tokenizer_json` (a file or a directory holding tokenizer.json); an
    existing `out_dir` is replaced. `dtype` casts the weights (default: as trained).
    Returns `out_dir` once the writer has finished (the tp group waits for it).

    With a `pp_group` of more than one rank, `model` is this rank's `StageModel`;
    every rank of the tp and pp groups calls it, `is_writer` marks each stage's
    writer (tp_rank 0 of the first dp replica), see the module docstring.

    `skip(name)`: leave that parameter out; `transform(name, local)`: the local shard to write
    instead of the parameter's own (LoRA's merged export, megaft.peft.export: both by our names).
    """
    if group_size(pp_group) > 1:
        return _export_stages(model, cfg, out_dir, tokenizer_json=tokenizer_json, tp_group=tp_group,
                              pp_group=pp_group, is_writer=is_writer, max_shard_bytes=max_shard_bytes, dtype=dtype,
                              skip=skip, transform=transform)
    out_dir = os.path.abspath(out_dir)
    params = [(n, p) for n, p in model_tensors(model) if skip is None or not skip(n)]  # persistent buffers too
    tp_size = group_size(tp_group)
    shards = _plan(params, tp_size, dtype, max_shard_bytes)
    tmp = None
    if is_writer:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
    try:
        weight_map, total = _write_shards(shards, 0, len(shards), tmp, tp_group, dtype, cfg, transform)
        if is_writer:
            with open(os.path.join(tmp, CONFIG), "w") as f:
                json.dump(hf_config_dict(cfg, dtype or params[0][1].dtype), f, indent=2)
            if len(shards) > 1:
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            if tokenizer_json:
                copy_tokenizer(tokenizer_json, tmp)
            _publish(tmp, out_dir)
    except BaseException:
        if tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if tp_size > 1:
        dist.barrier(group=tp_group)  # the directory exists for every tp rank on return
    return out_dir


def _write_shards(shards, first: int, total_files: int, tmp: Optional[str], tp_group: Group,
                  dtype: Optional[torch.dtype], cfg: ModelConfig, transform=None) -> tuple[dict[str, str], int]:
    """Gather and (on a writer, `tmp` set) save `shards` as files first+1.. of total_files
    (model.safetensors when it is the only one); returns (weight map, bytes written)."""
    weight_map, nbytes = {}, 0
    for i, shard in enumerate(shards):
        file = SINGLE if total_files == 1 else f"model-{first + i + 1:05d}-of-{total_files:05d}.safetensors"
        tensors = {}
        for name, p in shard:
            full = _full(p, tp_group, transform(name, p.detach()) if transform else None)  # collective over tp
            if tmp:
                tensors.update(hf_tensors(name, full.to("cpu", dtype or full.dtype), cfg))
        if tmp:
            save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
    return weight_map, nbytes


@torch.no_grad()
def _export_stages(model: nn.Module, cfg: ModelConfig, out_dir: str, *, tokenizer_json: Optional[str],
                   tp_group: Group, pp_group: Group, is_writer: bool, max_shard_bytes: int,
                   dtype: Optional[torch.dtype], skip=None, transform=None) -> str:
    """`export_hf` under pp: each stage writes its own files, the first stage publishes."""
    out_dir = os.path.abspath(out_dir)
    tied = "embed_tokens.weight" if getattr(model, "tied_copy", False) else None  # the first stage writes it
    params = [(n, p) for n, p in model_tensors(model) if n != tied and (skip is None or not skip(n))]
    shards = _plan(params, group_size(tp_group), dtype, max_shard_bytes)
    first_stage = group_rank(pp_group) == 0
    publisher = first_stage and is_writer
    counts: list = [None] * group_size(pp_group)
    dist.all_gather_object(counts, len(shards), group=pp_group)
    box = [None]  # the temporary directory, chosen by the publisher, known to every stage
    if publisher:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp_group, 0), group=pp_group)
    tmp = box[0] if is_writer else None
    try:
        written = _write_shards(shards, sum(counts[:group_rank(pp_group)]), sum(counts), tmp, tp_group, dtype,
                                cfg, transform)
        everything: list = [None] * group_size(pp_group)
        dist.all_gather_object(everything, written, group=pp_group)
        if publisher:
            weight_map = {k: v for wm, _ in everything for k, v in wm.items()}
            with open(os.path.join(tmp, CONFIG), "w") as f:
                json.dump(hf_config_dict(cfg, dtype or params[0][1].dtype), f, indent=2)
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": sum(n for _, n in everything)}, "weight_map": weight_map},
                          f, indent=2)
            if tokenizer_json:
                copy_tokenizer(tokenizer_json, tmp)
            _publish(tmp, out_dir)
    except BaseException:
        if publisher and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier(group=pp_group)  # published before any stage returns
    if group_size(tp_group) > 1:
        dist.barrier(group=tp_group)
    return out_dir
