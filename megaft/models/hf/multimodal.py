"""The text model of a multimodal checkpoint: taken out to fine-tune, and put back.

Gemma 3 4B, 12B and 27B are published as Gemma3ForConditionalGeneration (model_type
gemma3: a vision tower, a projector and a Gemma 3 text model). megaft fine-tunes the text
model:

    python -m megaft.models.hf.multimodal text  /ckpt/gemma-3-12b-it /ckpt/gemma-3-12b-it-text
    megaft-train model.init_from=/ckpt/gemma-3-12b-it-text train.export_hf=true ...
    python -m megaft.models.hf.multimodal merge /ckpt/gemma-3-12b-it RUN_DIR/hf /ckpt/gemma-3-12b-it-ft

`text` writes the text model as transformers' Gemma3ForCausalLM would save it: config.json
is the `text_config` with model_type gemma3_text; the language model's tensors
(`language_model.model.*` as transformers saves them, or `model.language_model.*`) become
`model.*`, an untied `lm_head` stays `lm_head`; the tokenizer files are copied. `merge`
writes the multimodal checkpoint again with the fine-tuned text tensors in place of the
original ones (same names, shapes checked), the vision tower and projector copied, the
multimodal config.json kept, and the fine-tuned run's tokenizer files (chat template
included) over the original's. One tensor is read at a time and shards of at most 5 GB are
written (with an index when there are several); a folder appears complete or not at all.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from safetensors import safe_open
from safetensors.torch import save_file

from megaft.models.arch.spec import HFCheckpointError
from megaft.models.hf.config import CONFIG, INDEX, SINGLE, read_hf_config
from megaft.models.hf.export import DEFAULT_MAX_SHARD_BYTES, copy_tokenizer_files
from megaft.models.hf.load import checkpoint_files
from megaft.models.hf.multimodal_config import MULTIMODAL, text_config  # noqa: F401  (this module's API too)

PREFIXES = ("language_model.model.", "model.language_model.")  # transformers' saved form, its in-memory form
HEADS = ("language_model.lm_head.", "lm_head.")


def text_name(name: str) -> Optional[str]:
    """The text model's name of a multimodal checkpoint's tensor; None for the vision parts."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    for prefix in HEADS:
        if name.startswith(prefix):
            return "lm_head." + name[len(prefix):]
    return None


def _multimodal_names(src: str) -> tuple[dict, dict]:
    """(name -> file, name -> text name or None) of the multimodal checkpoint `src`."""
    text_config(read_hf_config(src), os.path.join(src, CONFIG))
    files = checkpoint_files(src)
    names = {name: text_name(name) for name in files}
    if not any(n and n.startswith("model.layers.") for n in names.values()):
        raise HFCheckpointError(f"{src}: no language-model tensors (expected names starting with "
                                f"{' or '.join(PREFIXES)})")
    return files, names


def extract_text_model(src: str, dst: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write the text model of the multimodal checkpoint `src` to `dst` (module docstring)."""
    config = text_config(read_hf_config(src), os.path.join(src, CONFIG))
    files, names = _multimodal_names(src)
    config["tie_word_embeddings"] = "lm_head.weight" not in names.values()
    with _new_folder(dst) as tmp:
        _write_shards(tmp, _tensors(files, names), max_shard_bytes)
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        copy_tokenizer_files(src, tmp)
    return dst


def merge_text_model(multimodal: str, text: str, dst: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write `multimodal` to `dst` with the text model's tensors taken from the checkpoint `text`
    (module docstring); every language tensor must be there, with the original's shape."""
    files, names = _multimodal_names(multimodal)
    kind = read_hf_config(text).get("model_type")
    want = MULTIMODAL[read_hf_config(multimodal)["model_type"]][0]
    if kind != want:
        raise HFCheckpointError(f"{os.path.join(text, CONFIG)}: model_type {kind!r}, not the {want!r} text model of "
                                f"{multimodal}; fix: pass the folder megaft exported (RUN_DIR/hf) from a run that "
                                f"started from `python -m megaft.models.hf.multimodal text {multimodal} ...`")
    text_files = checkpoint_files(text)
    text_names = {n: n for n in text_files}
    mine = {new for new in names.values() if new is not None}
    missing, extra = sorted(mine - set(text_files)), sorted(set(text_files) - mine)
    if missing or extra:
        raise HFCheckpointError(f"{text}: its tensors are not the text model of {multimodal} (missing "
                                f"{missing[:5]}, extra {extra[:5]}); fix: the export of a run from that checkpoint")
    back = {new: name for name, new in names.items() if new is not None}  # text name -> multimodal name
    shapes = _shapes(files)

    def checked(new_name, tensor):
        name = back[new_name]
        if list(tensor.shape) != shapes[name]:
            raise HFCheckpointError(f"{text}: {new_name} has shape {list(tensor.shape)}, {multimodal} holds "
                                    f"{shapes[name]} as {name}; fix: the export of a run from that checkpoint")
        return name, tensor

    vision = {name: name for name, new in names.items() if new is None}
    with _new_folder(dst) as tmp:
        _write_shards(tmp, itertools.chain(_tensors(files, vision), _tensors(text_files, text_names, checked)),
                      max_shard_bytes)
        for entry in os.listdir(multimodal):  # config.json, the processor's and the tokenizer's files
            path = os.path.join(multimodal, entry)
            if os.path.isfile(path) and not entry.endswith(".safetensors") and entry != INDEX:
                shutil.copyfile(path, os.path.join(tmp, entry))
        copy_tokenizer_files(text, tmp)  # the fine-tuned run's tokenizer and chat template win
    return dst


def _shapes(files: dict) -> dict:
    out = {}
    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            out.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    return out


def _tensors(files: dict, names: dict, transform: Optional[Callable] = None) -> Iterator:
    """(new name, tensor) of every tensor of `files` that `names` maps (None: skipped), one file
    open at a time; `transform(new name, tensor)` may rename or check."""
    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                new = names.get(name)
                if new is not None:
                    tensor = f.get_tensor(name)
                    yield transform(new, tensor) if transform else (new, tensor)


def _write_shards(tmp: str, tensors: Iterator, max_shard_bytes: int) -> None:
    """`tensors` into shards of at most max_shard_bytes (one tensor may exceed it alone), named
    as save_pretrained names them, with an index when there are several."""
    shards, part, size = [], {}, 0

    def flush():
        nonlocal part, size
        if part:
            save_file(part, os.path.join(tmp, f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
            shards.append({k: t.numel() * t.element_size() for k, t in part.items()})
            part, size = {}, 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if part and size + nbytes > max_shard_bytes:
            flush()
        part[name], size = tensor, size + nbytes
    flush()
    if len(shards) == 1:
        os.rename(os.path.join(tmp, "part-0.safetensors"), os.path.join(tmp, SINGLE))
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(os.path.join(tmp, f"part-{i}.safetensors"), os.path.join(tmp, file))
        weight_map.update({name: file for name in shard})
    total = sum(sum(shard.values()) for shard in shards)
    with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


@contextmanager
def _new_folder(dst: str) -> Iterator[str]:
    """A temporary folder beside `dst`, renamed to `dst` when the body succeeds (removed if not);
    `dst` must not exist or be empty: nothing already saved is overwritten."""
    if os.path.exists(dst) and os.listdir(dst):
        raise FileExistsError(f"{dst}: exists and is not empty; fix: choose a new folder")
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    try:
        yield tmp
        if os.path.isdir(dst):
            os.rmdir(dst)  # empty (checked above)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megaft.models.hf.multimodal", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    text = sub.add_parser("text", help="write the text model of a multimodal checkpoint")
    text.add_argument("src", help="the multimodal checkpoint folder (config.json + *.safetensors)")
    text.add_argument("dst", help="a new folder for the text model")
    merge = sub.add_parser("merge", help="put a fine-tuned text model back into its multimodal checkpoint")
    merge.add_argument("multimodal", help="the multimodal checkpoint the text model was taken from")
    merge.add_argument("text", help="the fine-tuned text model (a run's RUN_DIR/hf or hf_merged)")
    merge.add_argument("dst", help="a new folder for the multimodal checkpoint")
    args = parser.parse_args(argv)
    try:
        if args.command == "text":
            out = extract_text_model(args.src, args.dst)
            print(f"megaft: wrote the text model of {args.src} to {out}; fine-tune it with model.init_from={out}")
        else:
            out = merge_text_model(args.multimodal, args.text, args.dst)
            print(f"megaft: wrote {out}: {args.multimodal} with the text model of {args.text}")
    except (HFCheckpointError, FileExistsError) as exc:
        raise SystemExit(f"megaft: {exc}") from None


if __name__ == "__main__":
    main()
