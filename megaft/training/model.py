"""The model part of a run: the kernels it uses and this rank's shard of it (HF weights or a
tp-independent init, LoRA adapters), and its parameter count."""
from __future__ import annotations

import math

import torch

from megaft.config import Config
from megaft.config.kernels import KernelsConfig
from megaft.kernels.autotune import decide_kernels
from megaft.models.decoder import Decoder
from megaft.models.vision.checks import trains_images
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.shard import full_shape
from megaft.peft.lora import apply_lora
from megaft.pipeline.stage import StageModel
from megaft.pipeline.vision import stage_language_model
from megaft.training.protocols import Kernels, RunParts


def choose_kernels(parts: RunParts) -> Kernels:
    """kernels.backend=auto on CUDA set to the backends measured fastest (rank 0 decides for
    all ranks), and each op's backend and its source for summary.json
    (megaft.kernels.autotune.decide_kernels)."""
    cfg, grid = parts.cfg, parts.grid
    return Kernels(*decide_kernels(cfg.kernels, cfg.model, tp=grid.tp_size, batch=cfg.train.micro_batch_size,
                                   seq=cfg.data.seq_len, precision=cfg.precision, device=grid.device,
                                   rank=grid.rank, master_weights=cfg.optim.master_weights))


def build_model(parts: RunParts) -> Decoder | StageModel:
    """The sharded model on this rank's device: HF weights or a tp-independent init.
    Under pp > 1 it is this rank's pipeline stages (`StageModel`, same parameter names).
    Built with parts.kernels (choose_kernels when not built yet)."""
    cfg, grid = parts.cfg, parts.grid
    par = cfg.parallel
    kernels = (parts.kernels or choose_kernels(parts)).config
    if trains_images(cfg):
        return build_vision_model(cfg, grid, kernels)
    if grid.pp_size > 1:
        model = StageModel(cfg.model, pp=grid.pp_size, pp_rank=grid.pp_rank, vpp=par.vpp, pp_layers=par.pp_layers,
                           group=grid.tp_group, sequence_parallel=par.sequence_parallel, kernels=kernels,
                           ep_group=grid.ep_group, routing=cfg.moe, tp_overlap=par.tp_overlap == "ring")
    else:
        model = Decoder(cfg.model, group=grid.tp_group, sequence_parallel=par.sequence_parallel, kernels=kernels,
                        ep_group=grid.ep_group, routing=cfg.moe, tp_overlap=par.tp_overlap == "ring")
    if cfg.model.init_from:
        from megaft.models.hf.load import load_hf_weights

        load_hf_weights(model, cfg.model.init_from, tp_rank=grid.tp_rank, tp_size=grid.tp_size,
                        strict=grid.pp_size == 1)
        if cfg.model.score_head:  # a reward model from a causal LM: its new head (a reward checkpoint has one)
            from megaft.models.hf.load import checkpoint_files
            from megaft.models.init import init_score

            if "score.weight" not in checkpoint_files(cfg.model.init_from):
                init_score(model, cfg.model, seed=cfg.train.seed)
    else:
        from megaft.models.init import init_params

        init_params(model, cfg.model, seed=cfg.train.seed, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    if cfg.lora.rank > 0:  # LoRA: freeze the base, attach seeded adapters (megaft.peft)
        apply_lora(model, cfg.lora, seed=cfg.train.seed, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    return model.to(grid.device)


def build_vision_model(cfg: Config, grid: ParallelGrid, kernels: KernelsConfig) -> torch.nn.Module:
    """The vision-language model of model.init_from (megaft.models.vision: Gemma 3 or Qwen2.5-VL):
    the language model sharded over tp, the tower (and projector) replicated; model.freeze's parts
    keep their loaded weights (no gradient, so no optimizer state: FlatParams takes trainable ones).
    Under pp the language model is this rank's stages and the first stage's rank holds the tower."""
    from megaft.models.vision.family import build_vision_language, tower_parts, vision_config_of
    from megaft.models.vision.hf import load_vision_language_weights

    par = cfg.parallel
    vcfg = vision_config_of(cfg.model.init_from, base=cfg.model)
    stages = None
    if grid.pp_size > 1:  # this rank's stages of the language model; the tower on the first stage's rank only
        stages = stage_language_model(vcfg.text, pp=grid.pp_size, pp_rank=grid.pp_rank, vpp=par.vpp,
                                      pp_layers=par.pp_layers, group=grid.tp_group,
                                      sequence_parallel=par.sequence_parallel, kernels=kernels)
    model = build_vision_language(vcfg, group=grid.tp_group, sequence_parallel=par.sequence_parallel,
                                  kernels=kernels, language_model=stages)
    load_vision_language_weights(model, cfg.model.init_from, tp_rank=grid.tp_rank, tp_size=grid.tp_size,
                                 strict=grid.pp_size == 1)
    if cfg.lora.rank > 0:  # the recipe of megaft.peft.vision: all frozen, adapters on the language model
        from megaft.peft.vision import apply_vision_lora

        apply_vision_lora(model, cfg.lora, seed=cfg.train.seed, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    parts = tower_parts(model)
    for name in cfg.model.freeze:
        for module in parts[name]:
            module.requires_grad_(False)
    return model.to(grid.device)


def model_params(model: torch.nn.Module, grid: ParallelGrid, *, trainable: bool = False) -> int:
    """Parameters of the whole (unsharded, unpadded) model; `trainable`: only those the
    optimizer updates (LoRA: the adapters). Under pp a sum over the stages (a collective)."""
    lm = getattr(model, "language_model", model)  # a vision-language model's stages are its language model's
    copy = lm.embed_tokens.weight if getattr(lm, "tied_copy", False) else None
    local = sum(math.prod(full_shape(p, grid.tp_size)) for p in model.parameters()
                if p is not copy and (p.requires_grad or not trainable))
    if grid.pp_size == 1:
        return local
    total = torch.tensor(float(local), dtype=torch.float64, device=grid.device)
    return int(all_reduce(total, grid.pp_group).item())
