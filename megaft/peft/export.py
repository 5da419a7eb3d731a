"""Export LoRA adapters in peft's format, and (optionally) the merged model.

`export_adapter` writes `adapter_config.json` and `adapter_model.safetensors` as
`peft.PeftModel.from_pretrained(base_model, dir)` reads them: tensor names
`base_model.model.<HF module>.lora_A.weight` / `.lora_B.weight` (A [r, in], B [out, r],
whole: gathered over tp, padding cropped, collected over pp), `target_modules` in HF's
module names, `r`, `lora_alpha`, `use_rslora`, `lora_dropout`. `export_merged` writes
the base with s * B A added to every adapted weight, as an HF checkpoint of the model's
own family (megaft.models.hf.export, one weight merged at a time on this rank's shard).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from megaft.config.lora import TARGET_MODULES, LoraConfig
from megaft.config.model import ModelConfig
from megaft.models.hf.config import hf_name
from megaft.models.hf.export import copy_tokenizer, export_hf, gather_full
from megaft.parallel.comm import Group, group_rank, group_size
from megaft.peft.experts import RouterAdapter, expert_adapters
from megaft.peft.lora import adapters, merged_weight
from megaft.peft.moe_export import expert_tensors, moe_targets, router_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_name(name: str, arch: str) -> str:
    """Our adapter parameter name (`layers.0.self_attn.q_proj.adapter.A`) -> peft's
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    module, _, which = name.rpartition(".adapter.")
    return "base_model.model." + hf_name(module + ".weight", arch).removesuffix(".weight") + f".lora_{which}.weight"


def adapter_config(cfg: LoraConfig, base: Optional[str], tensors: Optional[dict] = None,
                   moe: bool = False) -> dict:
    """peft's adapter_config.json of `cfg` (a LoraConfig of peft's, serialized). For a mixture of
    experts (`moe`), the MLP, router and expert adapters are `target_parameters` read from the
    exported `tensors`' names (megaft.peft.moe_export)."""
    modules = sorted(TARGET_MODULES[t] for t in cfg.targets if t in TARGET_MODULES)
    parameters, rank_pattern, alpha_pattern = [], {}, {}
    if moe:
        modules = [m for m in modules if m not in ("gate_proj", "up_proj", "down_proj")]
        parameters, rank_pattern, alpha_pattern = moe_targets(tensors or {}, cfg)
    out = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "inference_mode": True,
        # peft refuses dropout on parameter targets; dropout does nothing at inference
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": 0.0 if parameters else cfg.dropout,
        "use_rslora": cfg.rslora, "target_modules": modules or None, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None, "use_dora": False,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
    if parameters:
        out["target_parameters"] = parameters
    return out


@torch.no_grad()
def adapter_tensors(model: nn.Module, arch: str, tp_group: Group) -> dict[str, torch.Tensor]:
    """Every adapter tensor of this rank's model, whole, by peft name (collective over tp, and over
    ep for the experts')."""
    out = {}
    for module, adapter in adapters(model):
        for which, p in (("A", adapter.A), ("B", adapter.B)):
            name = (router_name(module, which) if isinstance(adapter, RouterAdapter)
                    else peft_name(f"{module}.adapter.{which}", arch))
            out[name] = gather_full(p, tp_group).float().cpu().contiguous()
    for module, adapter in expert_adapters(model):
        out.update(expert_tensors(module, adapter, tp_group))
    return out


def export_adapter(model: nn.Module, model_cfg: ModelConfig, cfg: LoraConfig, out_dir: str, *, tp_group: Group,
                   is_writer: bool, pp_group: Group = None, tokenizer_json: Optional[str] = None) -> str:
    """Write the adapters of `model` (tp-sharded, a pipeline stage's under pp) as a peft adapter
    folder `out_dir`. Collective over tp and pp; `is_writer` marks each stage's writer (tp rank 0
    of the first dp replica); the first stage's writer writes. Returns `out_dir`."""
    out_dir = os.path.abspath(out_dir)
    tensors = adapter_tensors(model, model_cfg.arch, tp_group)
    if group_size(pp_group) > 1:  # the adapters are small: collect them on the first stage
        parts: list = [None] * group_size(pp_group)
        dist.all_gather_object(parts, tensors if is_writer else {}, group=pp_group)
        tensors = {k: v for part in parts for k, v in part.items()}
    if is_writer and group_rank(pp_group) == 0:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
        try:
            save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
            with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
                json.dump(adapter_config(cfg, model_cfg.init_from, tensors, moe=model_cfg.n_experts > 0), f, indent=2)
            if tokenizer_json:  # with its chat template and config, as the full export (a chat LoRA keeps both)
                copy_tokenizer(tokenizer_json, tmp)
            if os.path.exists(out_dir):
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    for group in (pp_group, tp_group):
        if group_size(group) > 1:
            dist.barrier(group=group)  # written before any rank returns
    return out_dir


def export_merged(model: nn.Module, model_cfg: ModelConfig, out_dir: str, *, tp_group: Group, is_writer: bool,
                  pp_group: Group = None, tokenizer_json: Optional[str] = None) -> str:
    """The base model with every adapter merged (W + s * B A, fp32) as an HF checkpoint of its
    family in `out_dir`; the adapters themselves are left out. Collective like export_hf."""
    return export_hf(model, model_cfg, out_dir, tokenizer_json=tokenizer_json, tp_group=tp_group,
                     is_writer=is_writer, pp_group=pp_group, dtype=torch.float32,
                     skip=lambda name: ".adapter." in name,
                     transform=lambda name, local: merged_weight(model, name, local))


def export_lora(model: nn.Module, model_cfg: ModelConfig, cfg: LoraConfig, run_dir: str, *, tp_group: Group,
                is_writer: bool, pp_group: Group = None, tokenizer_json: Optional[str] = None) -> None:
    """A LoRA run's `train.export_hf`: the peft adapter folder RUN_DIR/hf and, with
    `lora.export_merged` (null = yes), the merged model RUN_DIR/hf_merged. Collective over tp and pp."""
    export_adapter(model, model_cfg, cfg, os.path.join(run_dir, "hf"), tp_group=tp_group, is_writer=is_writer,
                   pp_group=pp_group, tokenizer_json=tokenizer_json)
    if cfg.export_merged is not False:
        export_merged(model, model_cfg, os.path.join(run_dir, "hf_merged"), tp_group=tp_group,
                      is_writer=is_writer, pp_group=pp_group, tokenizer_json=tokenizer_json)
