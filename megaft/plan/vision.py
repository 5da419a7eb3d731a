"""The vision tower in megaft-plan (a vision-language model.init_from, docs/vision.md): its
parameters, its FLOPs per image and per step, and the activations it saves per image, at
plan.images_per_sample images of plan.image_size pixels per conversation (megaft.perf.vision).

Every layout counts it (`TowerLoad`): the first pipeline stage's rank holds the tower, whole on
every tp rank, its parameters, gradients and AdamW state sharded over dp×cp as ZeRO shards the
language model's (a frozen tower: its weights alone, whole), and the activations of its images
for each micro-batch in flight on that rank (none when frozen: nothing runs backward through
it); the step gains a `vision` term, the tower's FLOPs of the rank's share of the global batch
at the cluster's matmul rate, and its FLOPs count in the layout's MFU."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megaft.config import Config
from megaft.config.parallel import resolve_dp
from megaft.config.train import accumulation_steps
from megaft.data.qwen_images import smart_resize
from megaft.models.vision.checks import FREEZABLE, TRAINED, multimodal_kind
from megaft.models.vision.qwen_config import QwenVLConfig
from megaft.perf.counts import flops_per_token
from megaft.perf.memory import MemoryEstimate, estimate_ranks, in_flight
from megaft.perf.rates import compute_rates
from megaft.perf.time import StepCost
from megaft.perf.vision import (
    image_flops,
    projector_params,
    qwen_tower_activation_elements,
    qwen_tower_params,
    tower_activation_elements,
    tower_params,
)

# Qwen2.5-VL's processor defaults (min_pixels, max_pixels): an image's area is brought within them
QWEN_PIXELS = (56 * 56, 28 * 28 * 16384)


def vision_plan(cfg: Config, shaped: Config) -> Optional[dict]:
    """plan.json's "vision" block for `cfg`'s checkpoint (None for a text model); `shaped`: the
    planning config (its resolved language model)."""
    init_from = cfg.model.init_from
    if multimodal_kind(init_from) not in TRAINED:
        return None
    from megaft.models.vision.family import vision_config_of  # imports torch: only for a vision-language model

    vcfg, plan = vision_config_of(init_from), cfg.plan
    trains = cfg.lora.rank <= 0 and not set(FREEZABLE) <= set(cfg.model.freeze)
    v = vcfg.vision
    if isinstance(vcfg, QwenVLConfig):
        height, width = smart_resize(*plan.image_size, v.patch_size * v.merge, *QWEN_PIXELS)
        h, w = height // v.patch_size, width // v.patch_size
        params, tokens = qwen_tower_params(v), h * w // v.merge ** 2
        elements = qwen_tower_activation_elements(v, h, w)
        per_image = image_flops(vcfg, (1, h, w), trains=trains)
    else:  # Gemma 3: every image at the tower's resolution
        height = width = v.image_size
        h = w = v.patches_per_side
        params, tokens = tower_params(v) + projector_params(vcfg), vcfg.mm_tokens_per_image
        elements, per_image = tower_activation_elements(v), image_flops(vcfg, trains=trains)
    batch, seq = shaped.train.global_batch_size, shaped.data.seq_len
    text = flops_per_token(shaped.model, seq, shaped.lora) * seq * batch
    step = per_image * plan.images_per_sample * batch
    width_bytes = 2 if str(cfg.precision) in ("bf16", "fp16") else 4
    return {"model_type": multimodal_kind(init_from), "params": params, "trains": trains,
            "images_per_sample": plan.images_per_sample, "image_pixels": [height, width], "patches": [h, w],
            "tokens_per_image": tokens, "train_flops_per_image": per_image, "step_flops": step,
            "share_of_step_flops": step / (step + text),
            "activation_bytes_per_image": elements * width_bytes,
            "activation_bytes_per_sample": elements * width_bytes * plan.images_per_sample}


def format_vision(block: dict) -> str:
    """The printed line of the "vision" block."""
    h, w = block["image_pixels"]
    return (f"megaft-plan: vision tower ({block['model_type']}): {block['params'] / 1e6:.1f}M params, "
            f"{block['images_per_sample']} image(s) of {h}x{w} px ({block['patches'][0]}x{block['patches'][1]} "
            f"patches, {block['tokens_per_image']} tokens) per sample: {block['train_flops_per_image'] / 1e12:.2f} "
            f"TFLOPs per image in training ({'trained' if block['trains'] else 'frozen: forward only'}), "
            f"{block['share_of_step_flops']:.1%} of the step's model FLOPs, "
            f"{block['activation_bytes_per_sample'] / 2 ** 30:.2f} GiB of activations per sample"
            f"{'' if block['trains'] else ' (not kept: it is frozen)'}; the layouts below count it")


@dataclasses.dataclass(frozen=True)
class TowerLoad:
    """What the tower adds to a layout, per conversation of the global batch (its images)."""

    params: int
    trains: bool
    activation_bytes: int  # saved for backward per conversation (0 when frozen)
    flops: float  # model FLOPs of a conversation's images in a training step

    @classmethod
    def of(cls, block: dict) -> "TowerLoad":
        trains = block["trains"]
        return cls(block["params"], trains, block["activation_bytes_per_sample"] if trains else 0,
                   block["train_flops_per_image"] * block["images_per_sample"])

    def memory(self, cfg, world_size: int) -> MemoryEstimate:
        """The fullest rank's estimate of layout `cfg` with the tower on pp rank 0."""
        ranks = estimate_ranks(cfg, world_size)
        par = cfg.parallel
        replicas = resolve_dp(par, world_size) * par.cp
        weight, opt = (2, 12) if cfg.optim.master_weights else (4, 8)
        first = ranks[0]
        if self.trains:
            def shard(nbytes: int, stage: int) -> int:
                return self.params * nbytes // (replicas if par.zero >= stage else 1)
            micro = max(accumulation_steps(cfg.train, resolve_dp(par, world_size)), 1)
            live = math.ceil(in_flight(par.schedule, par.pp, par.vpp, 0, micro))
            first = dataclasses.replace(
                first, params=first.params + shard(weight, 3), grads=first.grads + shard(weight, 2),
                optimizer=first.optimizer + (0 if par.offload == "cpu" else shard(opt, 1)),
                activations=first.activations + self.activation_bytes * cfg.train.micro_batch_size * live)
        else:  # frozen: its weights, whole (not in the flat buffers ZeRO shards)
            first = dataclasses.replace(first, params=first.params + self.params * weight)
        return max([first, *ranks[1:]], key=lambda e: e.total)

    def cost(self, cost: StepCost, cfg, cluster, world_size: int) -> StepCost:
        """`cost` with the `vision` term (pp rank 0's images of the step at the matmul rate) and the
        tower's FLOPs in its MFU."""
        dp = resolve_dp(cfg.parallel, world_size)
        batch = cfg.train.global_batch_size
        seconds = self.flops * batch / dp / compute_rates(cluster, str(cfg.precision)).rate
        per_token = cost.flops_per_token + self.flops * batch / cost.tokens_per_step
        return dataclasses.replace(cost, terms={**cost.terms, "vision": seconds}, flops_per_token=per_token)
