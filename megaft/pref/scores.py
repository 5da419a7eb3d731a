"""The reference log-probs of a run's pairs, stored for the runs after it (pref.scores=DIR).

A run with a reference scores every pair once before step 1 (megaft.training.objectives.preference.step).
With `pref.scores` the result is kept in DIR under the fingerprint of everything it depends
on, and a run with the same fingerprint reads it instead of scoring: the points of a sweep
over beta, the learning rate or the layout share one scoring. The fingerprint covers the
reference's weights (config.json's text, and each weight file's name, size and
modification time: a re-exported checkpoint of the same shapes is another reference) or the
seeded init's seed; always the resolved model config (init_from's config.json under the
model.* overrides); the pairs files' contents (data.path's, or every data.sources file's);
the tokenizer; the text of the chat template actually used (data.chat_template's .jinja file,
the checkpoint's chat_template.jinja or tokenizer_config.json's template: an edited template
rescores); data.seq_len (which pairs are kept and how they are cut); the precision. Not the
layout: the scores of any layout are the same numbers up to fp32 summation order.

`pref.scores=store` keeps them beside the pairs, in the prepared store's folder of these pairs
(`<data.cache_dir>/<key>/scores/`): no folder to choose, and gone with the store.

A file holds [pairs, 4] (chosen sum, chosen count, rejected sum, rejected count) for the
training pairs and, with data.eval_path, for the held-out ones, as safetensors, with the
fingerprint's parts as metadata.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional

import torch

from megaft.fileio import file_sha256

WEIGHTS = (".safetensors", ".bin", ".pt")
# model fields that change memory and time, never a score: a sweep over them shares the scores
NOT_NUMBERS = {"recompute": "none", "recompute_layers": None}


def _checkpoint_identity(path: str) -> dict[str, Any]:
    """config.json's text and each weight file's (size, mtime) of a Hugging Face folder."""
    files = sorted(f for f in os.listdir(path) if f.endswith(WEIGHTS))
    with open(os.path.join(path, "config.json")) as f:
        config = f.read()
    return {"config_sha256": hashlib.sha256(config.encode()).hexdigest(),
            "weights": [[f, os.stat(os.path.join(path, f)).st_size, os.stat(os.path.join(path, f)).st_mtime_ns]
                        for f in files]}


def _tokenizer_identity(tokenizer_dir: Optional[str]) -> dict[str, str]:
    if tokenizer_dir is None:
        return {}
    return {f: file_sha256(os.path.join(tokenizer_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")
            if os.path.isfile(os.path.join(tokenizer_dir, f))}


def _pairs_identity(data):
    """data.path's sha256, or with data.sources every file's in order (the weights draw from the
    scored pairs: they do not change a score)."""
    if not data.sources:
        return file_sha256(data.path)
    from megaft.data.sources import source_files

    return [file_sha256(f) for s in data.sources for f in source_files(s.path)]


def fingerprint_parts(cfg) -> dict[str, Any]:
    """What the reference log-probs of `cfg`'s pairs depend on (a Config under a reference objective)."""
    from megaft.data.templates import tokenizer_dir_of

    source = cfg.pref.reference or cfg.model.init_from
    if source is not None:
        reference: dict[str, Any] = {"checkpoint": os.path.abspath(source), **_checkpoint_identity(source)}
    else:  # the seeded init of model.*
        reference = {"seed": cfg.train.seed}
    # always: model.* overrides on top of init_from change the reference's numbers too
    reference["model"] = repr(dataclasses.replace(_resolved_model(cfg.model), **NOT_NUMBERS))
    data = cfg.data
    tokenizer_dir = tokenizer_dir_of(data.tokenizer, cfg.model.init_from)
    return {"reference": reference,
            "pairs": _pairs_identity(data), "eval_pairs": file_sha256(data.eval_path) if data.eval_path else None,
            "tokenizer": _tokenizer_identity(tokenizer_dir),
            "chat_template": _template_identity(data.chat_template, tokenizer_dir),
            "seq_len": data.seq_len, "precision": str(cfg.precision)}


def _resolved_model(model):
    """model.* as the run builds it: init_from's config.json under the configured fields (the
    launcher fingerprints an unresolved config, the run a resolved one: both give this)."""
    if not model.init_from:
        return model
    from megaft.models.hf.config import hf_model_config

    return hf_model_config(model.init_from, base=model)


def _template_identity(choice: str, tokenizer_dir: Optional[str]) -> list:
    """The setting and the sha256 of the template text it resolves to (a .jinja file, the
    checkpoint's chat_template.jinja or tokenizer_config.json's): an edited file is another key."""
    from megaft.data.templates import load_chat_template

    template = load_chat_template(choice, tokenizer_dir)
    return [choice, template.sha256 if template is not None else None]


def fingerprint(cfg) -> str:
    """The store's key for `cfg`'s reference log-probs: a sha256 of `fingerprint_parts`."""
    return hashlib.sha256(json.dumps(fingerprint_parts(cfg), sort_keys=True).encode()).hexdigest()[:32]


STORE = "store"  # pref.scores=store: beside the pairs, in the prepared store (megaft.pref.store)


def scores_dir(cfg) -> str:
    """pref.scores, or with pref.scores=store the pair store's `scores/` folder."""
    if cfg.pref.scores != STORE:
        return cfg.pref.scores
    from megaft.pref.store import pairs_store_path

    store = pairs_store_path(cfg.data, init_from=cfg.model.init_from, eos_token_id=cfg.model.extra.get("eos_token_id"))
    return os.path.join(store, "scores")


def scores_path(cfg) -> str:
    return os.path.join(scores_dir(cfg), f"reference-{fingerprint(cfg)}.safetensors")


def save_scores(path: str, train: torch.Tensor, held_out: Optional[torch.Tensor], parts: dict[str, Any]) -> None:
    """Write the scores atomically (a reader never sees half a file)."""
    from safetensors.torch import save_file

    tensors = {"train": train.detach().float().cpu().contiguous()}
    if held_out is not None:
        tensors["eval"] = held_out.detach().float().cpu().contiguous()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"fingerprint": json.dumps(parts, sort_keys=True)})
    os.replace(tmp, path)


def load_scores(path: str, n_train: int, n_eval: Optional[int]
                ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """(train [n_train, 4], eval [n_eval, 4] or None) from `path`, or None when there is no such
    file or it does not hold these pair counts (then the run scores again and overwrites it)."""
    if not os.path.isfile(path):
        return None
    from safetensors.torch import load_file

    tensors = load_file(path)
    train, held_out = tensors.get("train"), tensors.get("eval")
    if train is None or tuple(train.shape) != (n_train, 4):
        return None
    if n_eval is not None and (held_out is None or tuple(held_out.shape) != (n_eval, 4)):
        return None
    return train, (held_out if n_eval is not None else None)
