"""LoRA on a vision-language model's language model (megaft.models.vision), the common recipe:
the tower and projector frozen, adapters on the language model's linears (`lora.targets`),
exported as a peft adapter of transformers' Gemma3ForConditionalGeneration or
Qwen2_5_VLForConditionalGeneration.

peft names the language model's modules by their path in transformers 5's model
(`base_model.model.model.language_model.layers.N...`, both families), and `target_modules` is a
regex that keeps the tower's projections out (SigLIP's q/k/v and Qwen2.5-VL's MLP have the
language model's names). Adapters on the tower
or projector: not yet (issue 43)."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from megaft.config.lora import TARGET_MODULES, LoraConfig
from megaft.models.hf.multimodal import _new_folder
from megaft.parallel.comm import Group, group_rank, group_size
from megaft.peft.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, adapter_tensors
from megaft.peft.lora import apply_lora

TEXT, VLM = "base_model.model.model.", "base_model.model.model.language_model."


def apply_vision_lora(model: nn.Module, cfg: LoraConfig, *, seed: int, tp_rank: int, tp_size: int) -> nn.Module:
    """Freeze the whole model, then attach seeded adapters to its language model's targeted linears."""
    for p in model.parameters():
        p.requires_grad_(False)
    apply_lora(model.language_model, cfg, seed=seed, tp_rank=tp_rank, tp_size=tp_size)
    return model


def vision_adapter_config(cfg: LoraConfig, base: Optional[str]) -> dict:
    """adapter_config.json: the text model's, its target modules matched inside the language model only."""
    out = adapter_config(cfg, base)
    modules = sorted(TARGET_MODULES[t] for t in cfg.targets if t in TARGET_MODULES and t != "lm_head")
    out["target_modules"] = rf".*language_model.*\.({'|'.join(modules)})"
    return out


def export_vision_adapter(model: nn.Module, cfg: LoraConfig, out_dir: str, *, tp_group: Group, is_writer: bool,
                          base: Optional[str] = None, pp_group: Group = None) -> str:
    """Write the language model's adapters as a peft adapter folder (collective over tp, and over
    pp: the adapters are small, the first stage's writer collects and writes them)."""
    if "lm_head" in cfg.targets:
        raise ValueError("lora.targets=lm_head on a vision-language model is not exported yet; fix: drop lm_head")
    tensors = {}
    for name, tensor in adapter_tensors(model.language_model, model.cfg.arch, tp_group).items():
        if not name.startswith(TEXT):
            raise ValueError(f"{name}: not a language-model adapter megaft can name for peft")
        tensors[VLM + name[len(TEXT):]] = tensor
    if group_size(pp_group) > 1:
        parts: list = [None] * group_size(pp_group)
        dist.all_gather_object(parts, tensors if is_writer else {}, group=pp_group)
        tensors = {k: v for part in parts for k, v in part.items()}
        is_writer = is_writer and group_rank(pp_group) == 0
    if is_writer:
        with _new_folder(out_dir) as tmp:
            save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
            with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
                json.dump(vision_adapter_config(cfg, base), f, indent=2)
    for group in (pp_group, tp_group):
        if group_size(group) > 1:
            dist.barrier(group=group)  # written before any rank returns
    return out_dir
