"""The text model of a multimodal checkpoint, saved as a checkpoint of its text family.

Gemma 3 4B, 12B and 27B are published as Gemma3ForConditionalGeneration (model_type
gemma3: a vision tower, a projector and a Gemma 3 text model). megaft fine-tunes the text
model; this writes it on its own, as transformers' Gemma3ForCausalLM would save it:

    python -m megaft.models.extract_text /ckpt/gemma-3-12b-it /ckpt/gemma-3-12b-it-text

config.json is the `text_config` with model_type gemma3_text; the language model's tensors
(`language_model.model.*` as transformers saves them, or `model.language_model.*`) become
`model.*`, an untied `lm_head` stays `lm_head`; the tokenizer files are copied. One tensor
is read at a time and shards of at most 5 GB are written (with an index when there are
several), so memory stays at one shard. The folder appears complete or not at all.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from safetensors import safe_open
from safetensors.torch import save_file

from megaft.models.arch.spec import HFCheckpointError
from megaft.models.hf_export import DEFAULT_MAX_SHARD_BYTES, TOKENIZER_SIDECARS
from megaft.models.hf_load import CONFIG, INDEX, SINGLE, checkpoint_files, read_hf_config

# multimodal model_type -> (text model_type, text architecture)
MULTIMODAL = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
PREFIXES = ("language_model.model.", "model.language_model.")  # transformers' saved form, its in-memory form
HEADS = ("language_model.lm_head.", "lm_head.")


def text_name(name: str) -> str | None:
    """The text model's name of a multimodal checkpoint's tensor; None for the vision parts."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    for prefix in HEADS:
        if name.startswith(prefix):
            return "lm_head." + name[len(prefix):]
    return None


def text_config(raw: dict, file: str) -> dict:
    kind = raw.get("model_type")
    if kind not in MULTIMODAL:
        raise HFCheckpointError(f"{file}: model_type {kind!r} is not a multimodal checkpoint megaft can take the "
                                f"text model of (it takes {', '.join(MULTIMODAL)}); a text checkpoint needs no "
                                "extraction: pass it to model.init_from")
    if not isinstance(raw.get("text_config"), dict):
        raise HFCheckpointError(f"{file}: no text_config object")
    model_type, arch = MULTIMODAL[kind]
    return {**raw["text_config"], "model_type": model_type, "architectures": [arch]}


def extract_text_model(src: str, dst: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write the text model of the multimodal checkpoint `src` to `dst` (module docstring)."""
    config = text_config(read_hf_config(src), os.path.join(src, CONFIG))
    if os.path.exists(dst) and os.listdir(dst):
        raise FileExistsError(f"{dst}: exists and is not empty; fix: choose a new folder")
    files = checkpoint_files(src)
    names = {name: text_name(name) for name in files}
    if not any(n and n.startswith("model.layers.") for n in names.values()):
        raise HFCheckpointError(f"{src}: no language-model tensors (expected names starting with "
                                f"{' or '.join(PREFIXES)})")
    config["tie_word_embeddings"] = "lm_head.weight" not in names.values()
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    try:
        shards = _write_tensors(src, files, names, tmp, max_shard_bytes)
        _index(tmp, shards)
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        for name in ("tokenizer.json",) + TOKENIZER_SIDECARS:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
        if os.path.isdir(dst):
            os.rmdir(dst)  # empty (checked above)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _write_tensors(src: str, files: dict, names: dict, tmp: str, max_shard_bytes: int) -> list[dict]:
    """The text tensors into tmp/part-N.safetensors, each at most max_shard_bytes (one tensor
    may exceed it alone); returns each part's {new name: bytes}."""
    shards, part, size = [], {}, 0

    def flush():
        nonlocal part, size
        if part:
            save_file(part, os.path.join(tmp, f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
            shards.append({k: t.numel() * t.element_size() for k, t in part.items()})
            part, size = {}, 0

    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                new = names.get(name)
                if new is None:
                    continue
                tensor = f.get_tensor(name)
                nbytes = tensor.numel() * tensor.element_size()
                if part and size + nbytes > max_shard_bytes:
                    flush()
                part[new], size = tensor, size + nbytes
    flush()
    return shards


def _index(tmp: str, shards: list[dict]) -> None:
    """Name the parts as save_pretrained does, with an index when there are several."""
    if len(shards) == 1:
        os.rename(os.path.join(tmp, "part-0.safetensors"), os.path.join(tmp, SINGLE))
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(os.path.join(tmp, f"part-{i}.safetensors"), os.path.join(tmp, file))
        weight_map.update({name: file for name in shard})
        total += sum(shard.values())
    with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megaft.models.extract_text", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="the multimodal checkpoint folder (config.json + *.safetensors)")
    parser.add_argument("dst", help="a new folder for the text model")
    args = parser.parse_args(argv)
    try:
        out = extract_text_model(args.src, args.dst)
    except (HFCheckpointError, FileExistsError) as exc:
        raise SystemExit(f"megaft: {exc}") from None
    print(f"megaft: wrote the text model of {args.src} to {out}; fine-tune it with model.init_from={out}")


if __name__ == "__main__":
    main()
