"""A multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration) into a
VisionLanguageModel and back.

Names, ours -> the published checkpoint's (google/gemma-3-*-it, as transformers 4 saves
them; transformers 5 reads them through its own renaming):

    language_model.<decoder name>  ->  language_model.model.<name>  (lm_head: language_model.lm_head.weight)
    vision_tower.<name>            ->  vision_tower.vision_model.<name>
    multi_modal_projector.<name>   ->  multi_modal_projector.<name>

Loading also takes transformers 5's forms (`vision_tower.<name>` as it saves them,
`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`
as it holds them in memory). Each tp rank reads only its rows of the language model's
sharded tensors (megaft.models.hf.load); the tower and projector are read whole. Export
gathers one tensor at a time over tp and writes the published names, with config.json as
Gemma3ForConditionalGeneration's and the tokenizer's files."""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from megaft.models.arch import spec_for
from megaft.models.arch.spec import HFCheckpointError
from megaft.models.hf.config import CONFIG
from megaft.models.hf.export import DEFAULT_MAX_SHARD_BYTES, copy_tokenizer, gather_full, hf_config_dict
from megaft.models.hf.load import Source, _read_into, checkpoint_files, tensors
from megaft.models.hf.multimodal import _new_folder, _write_shards
from megaft.models.vision.config import vision_config_dict
from megaft.models.vision.qwen_config import QwenVLConfig, qwen_config_dict
from megaft.parallel.comm import Group, group_rank, group_size
from megaft.parallel.tensor.shard import full_shape

LM, TOWER, PROJ, VISUAL = "language_model.", "vision_tower.", "multi_modal_projector.", "visual."
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # transformers 4's, 5's


def hf_names(name: str, arch: str) -> list[str]:
    """The checkpoint names of our parameter `name`, the published one first."""
    if name.startswith(LM):
        text = spec_for(arch).hf_name(name[len(LM):])  # model.X or lm_head.weight
        if text.startswith("model."):
            rest = text[len("model."):]
            return [f"language_model.model.{rest}", f"model.language_model.{rest}"]
        return [f"language_model.{text}", text]
    if name.startswith(TOWER):
        rest = name[len(TOWER):]
        return [f"vision_tower.vision_model.{rest}", f"vision_tower.{rest}", f"model.vision_tower.{rest}",
                f"model.vision_tower.vision_model.{rest}"]
    if name.startswith(PROJ):
        return [name, f"model.{name}"]
    raise ValueError(f"{name}: not a parameter of a VisionLanguageModel")


def qwen_hf_names(name: str, arch: str) -> list[str]:
    """Qwen2.5-VL's checkpoint names of our parameter `name`, the published one first
    (`model.X` / `lm_head.weight` / `visual.X`; transformers 5 holds `model.language_model.X` and
    `model.visual.X` in memory)."""
    if name.startswith(LM):
        text = spec_for(arch).hf_name(name[len(LM):])
        return [text, "model.language_model." + text[len("model."):]] if text.startswith("model.") else [text]
    if name.startswith(VISUAL):
        return [name, f"model.{name}"]
    raise ValueError(f"{name}: not a parameter of a QwenVLModel")


def names_of(model: nn.Module, name: str) -> list[str]:
    """The checkpoint names of `model`'s parameter `name` (Gemma 3 or Qwen2.5-VL)."""
    if isinstance(model.vlm, QwenVLConfig):
        return qwen_hf_names(name, model.cfg.arch)
    return hf_names(name, model.cfg.arch)


def _sources(model: nn.Module, files: dict[str, str], path: str, tp_size: int,
             strict: bool = True) -> dict[str, Source]:
    """Our names -> the checkpoint tensors that fill them; every problem at once (`strict`: also
    the checkpoint's tensors no parameter takes; a pipeline rank holds only its stages')."""
    problems, out = [], {}
    for name, param in tensors(model):
        names = names_of(model, name)
        found = next((n for n in names if n in files), None)
        if found is None:
            problems.append(f"missing {names[0]} (for {name})")
            continue
        out[name] = Source(found, tuple(full_shape(param, tp_size)))
    used = {s.hf for s in out.values()}
    ignored = {"language_model.lm_head.weight", "lm_head.weight"} if model.cfg.tie_embeddings else set()
    extra = sorted(n for n in files if n not in used and n not in ignored) if strict else []
    if extra:
        problems.append(f"unexpected tensors: {extra[:10]}{' ...' if len(extra) > 10 else ''}")
    for file in sorted({files[src.hf] for src in out.values()}):  # each file opened once
        with safe_open(file, "pt") as f:
            for src in out.values():
                if files[src.hf] == file and tuple(f.get_slice(src.hf).get_shape()) != src.shape:
                    problems.append(f"{src.hf} has shape {list(f.get_slice(src.hf).get_shape())}, expected "
                                    f"{list(src.shape)} from config.json")
    if problems:
        raise HFCheckpointError(f"{path}: cannot load the multimodal checkpoint:\n  " + "\n  ".join(problems))
    return out


@torch.no_grad()
def load_vision_language_weights(model: nn.Module, path: str, *, tp_rank: int, tp_size: int,
                                 strict: bool = True) -> None:
    """Fill a built VisionLanguageModel (language model sharded over tp_size) from `path`;
    names and shapes are all checked before any parameter changes (`strict`: every checkpoint
    tensor is used; false on a pipeline rank, which holds its stages only)."""
    files = checkpoint_files(path)
    wanted = _sources(model, files, path, tp_size, strict)
    params = dict(tensors(model))
    for file in sorted(set(files[s.hf] for s in wanted.values())):
        with safe_open(file, "pt") as f:
            for name, src in wanted.items():
                if files[src.hf] == file:
                    _read_into(f, src, params[name], tp_rank, tp_size)


def _gathered(model: nn.Module, group: Group, dtype: Optional[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """(published name, full tensor) of every parameter, gathered over tp one at a time
    (collective: every rank of `group` iterates it to the end)."""
    for name, param in tensors(model):
        full = gather_full(param, group)
        yield names_of(model, name)[0], full.to("cpu", dtype or full.dtype).contiguous()


def _stage_gathered(model: nn.Module, tp_group: Group, pp_group: Group, is_writer: bool,
                    dtype: Optional[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """`_gathered` under pp: every stage's parameters, stage after stage, yielded on the first
    stage's writer; each other stage's writer sends its tensors there, one at a time, in the same
    order (collective over tp and pp: every rank iterates it to the end). The last stage's tied
    embedding copy has the first stage's name and is left out."""
    own = [(names_of(model, n)[0], p) for n, p in tensors(model)]
    lists: list = [None] * group_size(pp_group)
    dist.all_gather_object(lists, [(name, str(p.dtype)) for name, p in own], group=pp_group)
    me, first = group_rank(pp_group), dist.get_global_rank(pp_group, 0)
    device = next(model.parameters()).device
    by_name, seen = dict(own), set()
    for rank, names in enumerate(lists):
        for name, kind in names:
            if name in seen:
                continue
            seen.add(name)
            if rank == me:
                full = gather_full(by_name[name], tp_group)
                if me == 0:
                    yield name, full.to("cpu", dtype or full.dtype).contiguous()
                elif is_writer:
                    shape = torch.tensor([full.dim(), *full.shape] + [0] * (7 - full.dim()), device=device)
                    dist.send(shape, first, group=pp_group)
                    dist.send(full.contiguous(), first, group=pp_group)
            elif me == 0 and is_writer:
                shape = torch.zeros(8, dtype=torch.long, device=device)
                dist.recv(shape, dist.get_global_rank(pp_group, rank), group=pp_group)
                buf = torch.empty(shape[1:1 + int(shape[0])].tolist(), dtype=getattr(torch, kind[len("torch."):]),
                                  device=device)
                dist.recv(buf, dist.get_global_rank(pp_group, rank), group=pp_group)
                yield name, buf.to("cpu", dtype or buf.dtype).contiguous()


def _copy_processor(tokenizer_json: str, dst: str) -> None:
    """The image processor's files beside the tokenizer (so transformers' AutoProcessor, and
    megaft.data.images, read the export as they read the original)."""
    src = tokenizer_json if os.path.isdir(tokenizer_json) else os.path.dirname(tokenizer_json)
    for name in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


@torch.no_grad()
def export_vision_language(model: nn.Module, out_dir: str, *, tokenizer_json: Optional[str], tp_group: Group,
                           is_writer: bool, dtype: Optional[torch.dtype] = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, pp_group: Group = None) -> str:
    """Write `model` as a Gemma3ForConditionalGeneration checkpoint in the new folder `out_dir`
    (collective over `tp_group`; `is_writer` writes), with the tokenizer's and the image
    processor's files from beside `tokenizer_json`. Under pp (`pp_group` of more than one rank)
    `model` is this rank's stages, and the first stage's writer writes every stage's tensors
    (`is_writer` marks each stage's tp rank 0 of the first replica). Returns `out_dir`."""
    staged = group_size(pp_group) > 1
    tensors_out = _stage_gathered(model, tp_group, pp_group, is_writer, dtype) if staged else \
        _gathered(model, tp_group, dtype)
    if staged and group_rank(pp_group) != 0:
        is_writer = False  # it sent its tensors to the first stage's writer
    if not is_writer:
        for _ in tensors_out:  # take part in every gather
            pass
    else:
        first_dtype = dtype or next(model.parameters()).dtype
        with _new_folder(out_dir) as tmp:
            _write_shards(tmp, tensors_out, max_shard_bytes)
            text = hf_config_dict(model.cfg, first_dtype)
            with open(os.path.join(tmp, CONFIG), "w") as f:
                write = qwen_config_dict if isinstance(model.vlm, QwenVLConfig) else vision_config_dict
                json.dump(write(model.vlm, text, str(first_dtype).removeprefix("torch.")), f, indent=2)
            if tokenizer_json:
                copy_tokenizer(tokenizer_json, tmp)
                _copy_processor(tokenizer_json, tmp)
    for group in (pp_group, tp_group):
        if group_size(group) > 1:
            dist.barrier(group=group)  # written before any rank returns
    return out_dir
