"""What validation says of a vision-language checkpoint in model.init_from, before any
rank starts: every unsupported combination at once, each with its fix (docs/vision.md).

Gemma 3 with images computes equal to transformers (megaft.models.vision) but megaft-train
does not feed images yet, so a multimodal checkpoint is refused with the way to fine-tune
its text model; the layouts images do not support yet (pp, cp, packing) are named too, so
a config that asks for them learns it now. Qwen2-VL and Qwen2.5-VL are not read yet."""
from __future__ import annotations

import json
import os

from megaft.config import Config

NOT_YET = {"qwen2_5_vl": "Qwen2.5-VL", "qwen2_vl": "Qwen2-VL"}


def multimodal_kind(init_from: str) -> str | None:
    """`gemma3` or a NOT_YET model_type when config.json describes a vision-language model, else None."""
    try:
        with open(os.path.join(init_from, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None  # the usual file checks report it
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind == "gemma3" and isinstance(raw.get("vision_config"), dict):
        return kind
    return kind if kind in NOT_YET else None


def check_vision_run(cfg: Config) -> list[str]:
    """Problems of training from a vision-language checkpoint (empty for any other model)."""
    init_from = cfg.model.init_from
    kind = multimodal_kind(init_from) if init_from else None
    if kind is None:
        return []
    where = f"model.init_from={init_from}"
    if kind in NOT_YET:
        return [f"{where}: model_type {kind} ({NOT_YET[kind]}) is not supported yet (megaft reads Gemma 3's "
                "vision-language checkpoints, docs/vision.md); fix: a Gemma 3 checkpoint, or a text model"]
    par, packing = cfg.parallel, str(cfg.data.packing)
    problems = [f"{where} is a vision-language Gemma 3 (Gemma3ForConditionalGeneration): megaft-train does not "
                "feed images to it yet (the model and the image data are megaft.models.vision and "
                "megaft.data.image_chat, docs/vision.md); fix: to fine-tune on text, take its text model out with "
                f"`python -m megaft.models.hf.multimodal text {init_from} DST` and set model.init_from=DST"]
    if par.pp > 1:
        problems.append(f"parallel.pp={par.pp} with images: the vision tower is not placed on a pipeline stage "
                        "yet; fix: parallel.pp=1")
    if par.cp > 1:
        problems.append(f"parallel.cp={par.cp} with images: an image's tokens attend to each other both ways, "
                        "across the cp chunks, which the ring does not do yet; fix: parallel.cp=1")
    if packing != "none":
        problems.append(f"data.packing={packing} with images: packing that keeps an image and its tokens in one "
                        "document is not supported yet; fix: data.packing=none (one conversation per row)")
    return problems
