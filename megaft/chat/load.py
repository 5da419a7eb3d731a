"""What `megaft-chat PATH` talks to: the HF folder of the weights, the tokenizer, the chat
template and the ids that end an answer (`locate`), and the model built from them on one
tp rank (`build_model`).

A RUN_DIR gives its newest complete checkpoint (checkpoints/), exported once as an HF
folder into RUN_DIR/eval/hf with LoRA adapters merged into the weights (the export
megaft-eval makes and reuses, megaft.eval.model_dir); a run without checkpoints gives its
hf_merged/ or hf/ export. Tokenizer, chat template (data.chat_template) and eos come from
the run's config.yaml, as training rendered its conversations. Any other folder must be an
HF checkpoint (config.json, *.safetensors, tokenizer.json); its template is its own
(chat_template.jinja or tokenizer_config.json).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional

import torch


class ChatError(Exception):
    """A problem that stops megaft-chat before it starts (one line with its fix)."""


@dataclass(frozen=True)
class ChatModel:
    """Everything a rank needs to answer: picklable, so the parent hands it to the tp ranks."""

    hf_dir: str  # the weights (an HF folder)
    tokenizer: str  # tokenizer.json
    template: Optional[object]  # megaft.data.templates.ChatTemplate, None: plain text continuation
    stop_ids: tuple[int, ...]  # the ids that end an answer
    origin: str  # what was found: "checkpoint-<step> of RUN_DIR", "RUN_DIR/hf", "HF_DIR"
    dtype: str = "fp32"  # autocast compute: the run's precision, or --dtype (fp32 | bf16 | fp16)
    kernels: Optional[object] = None  # the run's KernelsConfig (None: megaft's defaults)
    routing: Optional[object] = None  # the run's MoEConfig (None: megaft's defaults)


def locate(path: str, template: str = "auto", dtype: Optional[str] = None) -> ChatModel:
    """The ChatModel of a RUN_DIR or an HF_DIR (module docstring); `template` overrides the
    chat template (auto | llama3 | chatml | a .jinja file), `dtype` the compute precision (a run's
    precision, else fp32). A run's kernels and MoE routing settings come with it. Raises ChatError."""
    from megaft.data.templates import load_chat_template, tokenizer_dir_of
    from megaft.eval.model_dir import is_hf_model
    from megaft.run_dir import is_run_dir

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ChatError(f"{path} is not a directory; fix: a run dir or a Hugging Face checkpoint folder")
    if is_run_dir(path):
        hf_dir, origin, cfg = _run_weights(path)
        run = dict(dtype=str(cfg.precision), kernels=cfg.kernels, routing=cfg.moe) if cfg else {}
        tok_dir = tokenizer_dir_of(cfg.data.tokenizer, cfg.model.init_from) if cfg else None
        choice = cfg.data.chat_template if cfg and template == "auto" else template
    elif is_hf_model(path):
        hf_dir, origin, tok_dir, choice, run = path, path, path, template, {}
    else:
        raise ChatError(f"{path} is neither a run dir (config.yaml, metrics.jsonl or summary.json) nor a Hugging Face "
                        "checkpoint (config.json with model.safetensors or its index); fix: point megaft-chat at one")
    tokenizer = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise ChatError(f"{tokenizer} is missing; fix: copy the model's tokenizer.json into {hf_dir}")
    chat = load_chat_template(choice, tok_dir or hf_dir)
    if dtype is not None:
        run["dtype"] = dtype
    return ChatModel(hf_dir, tokenizer, chat, _stop_ids(hf_dir, tokenizer, chat), origin, **run)


def _run_weights(run_dir: str):
    """(hf_dir, origin, the run's Config or None) of a run dir: its newest checkpoint exported
    (cached in RUN_DIR/eval/hf), else its hf_merged/ or hf/ export."""
    from megaft.checkpoint.io import find_latest
    from megaft.eval.model_dir import EXPORT_DIR, EXPORT_STEP, export_checkpoint, is_hf_model
    from megaft.training.run_config import read_run_config

    run = read_run_config(run_dir)
    latest, _ = find_latest(os.path.join(run_dir, "checkpoints"))
    if latest is not None:
        if run is None:
            raise ChatError(f"{run_dir} has checkpoints but no config.yaml to rebuild the model from; fix: point "
                            "megaft-chat at its HF export (train.export_hf=true)")
        step, ckpt = latest
        hf_dir = os.path.join(run_dir, EXPORT_DIR)
        if not (is_hf_model(hf_dir) and _read_step(os.path.join(hf_dir, EXPORT_STEP)) == step):
            print(f"megaft-chat: exporting checkpoint step {step} to {hf_dir} (LoRA adapters merged)", flush=True)
            export_checkpoint(run_dir, ckpt, hf_dir)
            with open(os.path.join(hf_dir, EXPORT_STEP), "w") as f:
                f.write(f"{step}\n")
        return hf_dir, f"checkpoint-{step} of {run_dir}", run.config
    for name in ("hf_merged", "hf"):
        if is_hf_model(os.path.join(run_dir, name)):
            return os.path.join(run_dir, name), os.path.join(run_dir, name), run.config if run else None
    raise ChatError(f"{run_dir} has no model to chat with: no complete checkpoint in "
                    f"{os.path.join(run_dir, 'checkpoints')} and no hf/ or hf_merged/ export; fix: train with "
                    "train.save_final=true (the default) or train.export_hf=true")


def _read_step(file: str) -> Optional[int]:
    try:
        with open(file) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _stop_ids(hf_dir: str, tokenizer: str, template) -> tuple[int, ...]:
    """Every id that ends an answer: config.json's eos_token_id(s), the template's eos_token
    (ChatML's <|im_end|>: the end of a turn) and the tokenizer's own eos (megaft.data.tokenizer)."""
    from tokenizers import Tokenizer

    from megaft.data.tokenizer import special_ids
    from megaft.models.hf.config import read_hf_config

    listed = read_hf_config(hf_dir).get("eos_token_id")
    ids = set(listed if isinstance(listed, list) else [listed])
    tok = Tokenizer.from_file(tokenizer)
    ids.add(special_ids(tok, listed)[0])
    if template is not None and template.special_tokens.get("eos_token"):
        ids.add(tok.token_to_id(template.special_tokens["eos_token"]))
    return tuple(sorted(i for i in ids if i is not None))


def build_model(chat: ChatModel, *, tp_rank: int = 0, tp_size: int = 1, group=None,
                device: torch.device = torch.device("cpu")):
    """This tp rank's Decoder of `chat.hf_dir` (its slice of every sharded weight), in eval mode,
    with the run's kernels (auto ones decided as megaft-train does) and MoE routing; a
    vision-language checkpoint's VisionLanguageModel (tower replicated, megaft.models.vision)."""
    from megaft.models.decoder import Decoder
    from megaft.models.hf.config import hf_model_config
    from megaft.models.hf.load import load_hf_weights

    if is_vision_language(chat):
        from megaft.models.vision.family import build_vision_language, vision_config_of
        from megaft.models.vision.hf import load_vision_language_weights

        vlm = build_vision_language(vision_config_of(chat.hf_dir), group=group)
        load_vision_language_weights(vlm, chat.hf_dir, tp_rank=tp_rank, tp_size=tp_size)
        return vlm.to(device).eval()
    cfg = hf_model_config(chat.hf_dir)
    kernels = chat.kernels
    if kernels is not None:
        from megaft.kernels.autotune import decide_kernels

        kernels, _ = decide_kernels(kernels, cfg, tp=tp_size, batch=1, seq=min(cfg.max_seq_len, 2048),
                                    precision=chat.dtype, device=device, rank=tp_rank)
    model = Decoder(cfg, group=group, kernels=kernels, routing=chat.routing)
    load_hf_weights(model, chat.hf_dir, tp_rank=tp_rank, tp_size=tp_size)
    return model.to(device).eval()


def is_vision_language(chat: ChatModel) -> bool:
    """Whether `chat.hf_dir` is a vision-language Gemma 3 or Qwen2.5-VL (megaft.models.vision)."""
    from megaft.models.hf.config import read_hf_config
    from megaft.models.vision.config import is_multimodal
    from megaft.models.vision.qwen_config import is_qwen_vl

    raw = read_hf_config(chat.hf_dir)
    return is_multimodal(raw) or is_qwen_vl(raw)


def max_seq_len(chat: ChatModel) -> int:
    """The longest sequence the model of `chat` reads (its language model's)."""
    if is_vision_language(chat):
        from megaft.models.vision.family import vision_config_of

        return vision_config_of(chat.hf_dir).text.max_seq_len
    from megaft.models.hf.config import hf_model_config

    return hf_model_config(chat.hf_dir).max_seq_len


def compute(chat: ChatModel, device: torch.device):
    """The autocast context of `chat.dtype` (fp32 weights, as in training), a no-op for fp32."""
    if chat.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if chat.dtype == "bf16" else torch.float16)
