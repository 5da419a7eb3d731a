"""What validation says of a vision-language checkpoint in model.init_from, before any
rank starts: every unsupported combination at once, each with its fix (docs/vision.md).

megaft-train trains a multimodal Gemma 3 with images (megaft.training.objectives.images) on
the layouts tested equal to one process: tp (with or without sequence parallel), dp with
ZeRO 0-3, and pp (the tower on the first stage, megaft.models.vision.staged). What those
tests do not cover yet is refused by name, so a config that asks for it learns it now:
cp, packing, LoRA on the head or exported merged, objectives other than sft,
an eval file and samples (both would need images). Qwen2.5-VL trains the same
way (megaft.models.vision.qwen_model) on the layouts tested for it: tp (with or without
sequence parallel), dp with ZeRO 0-3 and pp, LoRA on its language model. Qwen2-VL is not read yet."""
from __future__ import annotations

import json
import os
from typing import Optional

from megaft.config import Config
from megaft.config.keep import exports_merged

NOT_YET = {"qwen2_vl": "Qwen2-VL"}
TRAINED = ("gemma3", "qwen2_5_vl")  # the vision-language model_types megaft-train trains with images
# model.freeze's names: the tower and the projector (Qwen2.5-VL: the tower without its patch merger, the merger)
FREEZABLE = ("vision", "projector")


def multimodal_kind(init_from: Optional[str]) -> str | None:
    """A TRAINED or NOT_YET model_type when config.json describes a vision-language model, else None."""
    if not init_from:
        return None
    try:
        with open(os.path.join(init_from, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None  # the usual file checks report it
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind in TRAINED and isinstance(raw.get("vision_config"), dict):
        return kind
    return kind if kind in NOT_YET else None


def trains_images(cfg: Config) -> bool:
    """True when the run trains a vision-language model with images (its model, data and step parts)."""
    return multimodal_kind(cfg.model.init_from) in TRAINED


def check_vision_run(cfg: Config) -> list[str]:
    """Problems of training from a vision-language checkpoint (empty for any other model, and
    for a Gemma 3 run on a supported layout)."""
    init_from = cfg.model.init_from
    kind, freeze = multimodal_kind(init_from), list(cfg.model.freeze)
    if kind is None:
        return [f"model.freeze={freeze}: only a vision-language model has parts to freeze (vision, projector); "
                "fix: model.freeze=[]"] if freeze else []
    where = f"model.init_from={init_from}"
    if kind in NOT_YET:
        return [f"{where}: model_type {kind} ({NOT_YET[kind]}) is not supported yet (megaft trains Gemma 3 and "
                "Qwen2.5-VL with images, docs/vision.md); fix: a Gemma 3 or Qwen2.5-VL checkpoint, or a text model"]
    par, data, packing = cfg.parallel, cfg.data, str(cfg.data.packing)
    text_fix = ("" if kind == "qwen2_5_vl" else  # megaft.models.hf.multimodal takes Gemma 3's text model only
                f"or, to fine-tune on text, take its text model out with `python -m megaft.models.hf.multimodal "
                f"text {init_from} DST` and set model.init_from=DST")
    problems = [f"model.freeze: {name!r} is not a part of the model; fix: a list of {', '.join(FREEZABLE)}"
                for name in freeze if name not in FREEZABLE]
    if par.cp > 1:
        why = ("Gemma 3: an image's tokens attend to each other both ways, which the ring does not do across "
               "chunks" if kind == "gemma3" else
               "Qwen2.5-VL: its M-RoPE positions and image features are not split over the chunks")
        problems.append(f"parallel.cp={par.cp} with images: cp on the text part needs each image's tokens whole in "
                        f"one rank's chunk, and megaft does not place them so yet ({why}); fix: parallel.cp=1")
    if packing != "none":
        problems.append(f"data.packing={packing} with images: packing that keeps an image and its tokens in one "
                        "document is not supported yet; fix: data.packing=none (one conversation per row)")
    if cfg.lora.rank > 0 and "lm_head" in cfg.lora.targets:
        problems.append("lora.targets=lm_head with images: an adapter on the head of a vision-language model is "
                        "not exported yet; fix: drop lm_head from lora.targets")
    if exports_merged(cfg) and trains_images(cfg):
        problems.append(f"lora.rank={cfg.lora.rank} with images writes the peft adapter only, not the merged model "
                        "yet; fix: lora.export_merged=false")
    if str(cfg.train.objective) != "sft":
        problems.append(f"train.objective={cfg.train.objective} with images: only sft reads image chats yet; "
                        "fix: train.objective=sft")
    if not data.path or data.sources:
        problems.append(f"{where} trains on image chats: data.path must name one JSONL file of conversations "
                        f"(a data.sources mixture or a generated task is not read yet); fix: data.path=FILE"
                        + (f", {text_fix}" if text_fix else ""))
    if data.eval_path:
        problems.append("data.eval_path with images: evaluation does not feed images yet; fix: unset "
                        "data.eval_path")
    if cfg.train.sample_every > 0:
        problems.append("train.sample_every with images: samples do not take an image yet; fix: "
                        "train.sample_every=0 (megaft-chat --image answers with an image)")
    return problems
