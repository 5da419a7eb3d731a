"""The Hugging Face folder `megaft-eval` evaluates, and where its results go.

A RUN_DIR gives, in this order: RUN_DIR/hf_merged (a LoRA run's merged export), RUN_DIR/hf
(train.export_hf of a full fine-tune; a peft adapter folder there is not a whole model),
RUN_DIR/eval/hf when an earlier megaft-eval exported it from the same checkpoint, else the
newest complete checkpoint in RUN_DIR/checkpoints exported now into RUN_DIR/eval/hf
(single process, LoRA adapters merged). Any other folder must be an HF checkpoint itself.
Results go to RUN_DIR/eval/, for an HF folder inside a run dir (RUN_DIR/hf) to that run's
eval/, else to HF_DIR/eval/.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from megaft.models.hf.config import CONFIG, INDEX, SINGLE
from megaft.run_dir import is_run_dir

EXPORT_DIR = os.path.join("eval", "hf")  # a checkpoint's export, inside the run dir
EXPORT_STEP = ".megaft_step"  # the checkpoint step an eval/hf export came from


class EvalError(Exception):
    """A problem that stops megaft-eval before lm_eval runs (one line with its fix)."""


@dataclass(frozen=True)
class Target:
    hf_dir: str  # the HF checkpoint folder lm_eval loads
    out_dir: str  # where results.json goes
    run_dir: Optional[str]  # the run it belongs to, if any
    origin: str  # how the folder was found: hf, hf_merged, checkpoint-<step>, folder


def is_hf_model(path: str) -> bool:
    """A whole model (config.json and weights), not a peft adapter folder."""
    return (os.path.isfile(os.path.join(path, CONFIG))
            and any(os.path.isfile(os.path.join(path, f)) for f in (SINGLE, INDEX)))


def locate(path: str, *, export: bool = True) -> Target:
    """The Target of a RUN_DIR or an HF_DIR (see the module docstring); exports the newest
    checkpoint when a run dir has no HF folder. Raises EvalError when there is nothing to read."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise EvalError(f"{path} is not a directory; fix: a run dir or a Hugging Face checkpoint folder")
    if not is_run_dir(path):
        if not is_hf_model(path):
            raise EvalError(f"{path} is neither a run dir (no summary.json, metrics.jsonl, config.yaml) nor a "
                            f"Hugging Face checkpoint ({CONFIG} with {SINGLE} or {INDEX}); fix: point megaft-eval "
                            "at one of them")
        parent = os.path.dirname(path)
        out = os.path.join(parent, "eval") if is_run_dir(parent) else os.path.join(path, "eval")
        return Target(path, out, parent if is_run_dir(parent) else None, "folder")
    out = os.path.join(path, "eval")
    for name in ("hf_merged", "hf"):
        if is_hf_model(os.path.join(path, name)):
            return Target(os.path.join(path, name), out, path, name)
    from megaft.checkpoint.io import find_latest

    latest, _ = find_latest(os.path.join(path, "checkpoints"))
    if latest is None:
        raise EvalError(f"{path} has no model to evaluate: no hf/ or hf_merged/ export and no complete checkpoint in "
                        f"{os.path.join(path, 'checkpoints')}; fix: train with train.export_hf=true or "
                        "train.save_final=true (the default)")
    step, ckpt = latest
    hf_dir = os.path.join(path, EXPORT_DIR)
    if is_hf_model(hf_dir) and _export_step(hf_dir) == step:
        return Target(hf_dir, out, path, f"checkpoint-{step}")
    if not export:
        raise EvalError(f"{path}: checkpoint step {step} is not exported yet")
    export_checkpoint(path, ckpt, hf_dir)
    with open(os.path.join(hf_dir, EXPORT_STEP), "w") as f:
        f.write(f"{step}\n")
    return Target(hf_dir, out, path, f"checkpoint-{step}")


def _export_step(hf_dir: str) -> Optional[int]:
    try:
        with open(os.path.join(hf_dir, EXPORT_STEP)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def export_checkpoint(run_dir: str, ckpt_dir: str, out_dir: str) -> str:
    """The model of checkpoint `ckpt_dir` (any layout) as an HF folder, in one process:
    the run's model rebuilt from RUN_DIR/config.yaml, its base weights as the run started
    (model.init_from, else the seeded init), every saved tensor copied in, LoRA merged."""
    import torch

    from megaft.checkpoint.reshard import named_tensors
    from megaft.models.decoder import Decoder
    from megaft.models.hf.export import export_hf
    from megaft.training.run_config import read_run_config

    run = read_run_config(run_dir)
    if run is None:
        raise EvalError(f"{run_dir} has checkpoints but no config.yaml to rebuild the model from; fix: export "
                        "with train.export_hf=true")
    cfg = run.config
    model = Decoder(cfg.model, routing=cfg.moe)
    if cfg.model.init_from:
        from megaft.models.hf.load import load_hf_weights

        load_hf_weights(model, cfg.model.init_from, tp_rank=0, tp_size=1)
    else:
        from megaft.models.init import init_params

        init_params(model, cfg.model, seed=cfg.train.seed, tp_rank=0, tp_size=1)
    if cfg.lora.rank > 0:
        from megaft.peft.lora import apply_lora

        apply_lora(model, cfg.lora, seed=cfg.train.seed, tp_rank=0, tp_size=1)
    saved = named_tensors(ckpt_dir)
    params = dict(model.named_parameters())
    unknown = sorted(set(saved) - set(params))
    if unknown:
        raise EvalError(f"{ckpt_dir} holds tensors the rebuilt model lacks ({', '.join(unknown[:3])}...); fix: "
                        "evaluate the run's HF export (train.export_hf=true)")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor.reshape(params[name].shape))
    tok = _tokenizer_json(run_dir, cfg)
    if cfg.lora.rank > 0:
        from megaft.peft.export import export_merged

        return export_merged(model, cfg.model, out_dir, tp_group=None, is_writer=True, tokenizer_json=tok)
    return export_hf(model, cfg.model, out_dir, tokenizer_json=tok, tp_group=None, is_writer=True)


def _tokenizer_json(run_dir: str, cfg) -> Optional[str]:
    from megaft.data.tokenizer import tokenizer_file

    if cfg.data.tokenizer or cfg.model.init_from:
        return tokenizer_file(cfg.data.tokenizer or cfg.model.init_from)
    own = os.path.join(run_dir, "tokenizer.json")  # a tokenizer trained for the run (megaft.training.export)
    return own if os.path.isfile(own) else None


def ensure_tokenizer_config(hf_dir: str) -> Optional[str]:
    """Write tokenizer_config.json beside a tokenizer.json that has none (megaft's own tokenizers
    travel without one), naming its eos and pad tokens, so transformers' AutoTokenizer, and
    lm_eval through it, know them. Returns the file written, or None."""
    tok_file, cfg_file = os.path.join(hf_dir, "tokenizer.json"), os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_file) or not os.path.isfile(tok_file):
        return None
    from tokenizers import Tokenizer

    from megaft.data.tokenizer import special_ids

    tok = Tokenizer.from_file(tok_file)
    with open(os.path.join(hf_dir, CONFIG)) as f:
        eos_id = json.load(f).get("eos_token_id")
    eos, pad = special_ids(tok, eos_id[0] if isinstance(eos_id, list) else eos_id)
    record = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos is not None:
        record["eos_token"] = tok.id_to_token(eos)
    if pad is not None and tok.id_to_token(pad) is not None:
        record["pad_token"] = tok.id_to_token(pad)
    if tok.token_to_id("<unk>") is not None:
        record["unk_token"] = "<unk>"
    with open(cfg_file, "w") as f:
        json.dump(record, f, indent=2)
    return cfg_file
