"""The prepared dataset: flat token, target and offset arrays plus a manifest.

A prepared directory `<cache_dir>/<key>/` holds

    tokens.bin     uint32 [tokens]       every document's ids, back to back
    target.bin     uint8  [tokens]       1 where the token is a prediction target
    offsets.npy    int64  [docs + 1]     document d is tokens offsets[d] .. offsets[d+1]-1
    source.npy     int32  [docs]         which data.sources entry document d came from
    prompt_len.npy int32  [docs]         Encoded.prompt_len (what PackedStream keeps in view)
    manifest.json  written last          sources, tokenizer, template, options, counts, and
                                         each array's size and sha256 (computed as it is written)

and nothing else; it appears by an atomic rename of a finished temporary
directory, so a directory named by a key is always complete. The key is a hash
of everything the arrays depend on (see `cache_key`), so a changed source file,
tokenizer, template or option names a new directory instead of reusing a stale one.
Readers memory-map every array: opening costs the same for 1 MB and 1 TB, and
pages are read on demand and shared by all ranks of a node through the page cache.

A store damaged after it was written (a truncated or overwritten array) is never used:
opening checks every array's size against the manifest, and with `verify="full"`
(data.verify_store, the default) its sha256 and the largest token id against the
vocabulary. A full check that passed is remembered in `verified.json` (each array's size
and modification time), so it costs one read of the arrays after each change, not one
per run or per rank.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
from typing import Optional

import numpy as np

from megaft.data.encode import Encoded
from megaft.data.errors import DataError
from megaft.fileio import file_sha256

FORMAT_VERSION = 2  # 2: the manifest records each array's size and sha256
MANIFEST = "manifest.json"
STAMP = "verified.json"
TOKEN_DTYPE = np.uint32
ARRAYS = ("tokens.bin", "target.bin", "offsets.npy", "source.npy", "prompt_len.npy")


class StoreDamagedError(DataError):
    """A prepared directory whose arrays no longer match their manifest (or the vocabulary)."""


def cache_key(identity: dict) -> str:
    """Directory name of a prepared dataset: sha256 of its canonical JSON identity
    (format version, source fingerprints, tokenizer hash, template hash, options)."""
    blob = json.dumps({"format": FORMAT_VERSION, **identity}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def is_complete(path: str) -> bool:
    """Whether `path` is a finished prepared directory (the manifest is written last)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


class PreparedWriter:
    """Appends encoded documents to a (temporary) directory, then writes the index."""

    def __init__(self, path: str):
        self.path = path
        self._tokens = open(os.path.join(path, "tokens.bin"), "wb")
        self._target = open(os.path.join(path, "target.bin"), "wb")
        self._sha = {"tokens.bin": hashlib.sha256(), "target.bin": hashlib.sha256()}  # as the bytes go out
        self.max_token_id = -1
        # array.array: 8 bytes a document while preparing (a list of ints costs ~36).
        self.lengths, self.sources, self.prompt_lens = array.array("q"), array.array("i"), array.array("i")
        self.targets = self.untrained = 0

    def add(self, ids: np.ndarray, target: np.ndarray, lengths: np.ndarray, prompt_lens: np.ndarray,
            source: int) -> None:
        """Append documents whose concatenated ids/target are given, with their lengths."""
        for name, f, data in (("tokens.bin", self._tokens, np.ascontiguousarray(ids, dtype=TOKEN_DTYPE).tobytes()),
                              ("target.bin", self._target, np.ascontiguousarray(target, dtype=np.uint8).tobytes())):
            f.write(data)
            self._sha[name].update(data)
        if len(ids):
            self.max_token_id = max(self.max_token_id, int(np.max(ids)))
        self.lengths.frombytes(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
        self.prompt_lens.frombytes(np.ascontiguousarray(prompt_lens, dtype=np.int32).tobytes())
        self.sources.extend([source] * len(lengths))
        self.targets += int(np.count_nonzero(target))
        # Documents with nothing to learn (no assistant turn, empty text) are counted in the manifest.
        filled = lengths > 0
        starts = (np.cumsum(lengths) - lengths)[filled]  # strictly increasing: reduceat sums each document
        per_doc = np.add.reduceat(np.asarray(target, dtype=np.int64), starts) if starts.size else starts
        self.untrained += int(len(lengths) - filled.sum() + np.count_nonzero(per_doc == 0))

    def close(self, manifest: dict) -> dict:
        """Flush the arrays, then write the manifest (last: it marks completeness)."""
        for f in (self._tokens, self._target):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(self.lengths, dtype=np.int64), out=offsets[1:])
        np.save(os.path.join(self.path, "offsets.npy"), offsets)
        np.save(os.path.join(self.path, "source.npy"), np.frombuffer(self.sources, dtype=np.int32))
        np.save(os.path.join(self.path, "prompt_len.npy"), np.frombuffer(self.prompt_lens, dtype=np.int32))
        sums = {name: h.hexdigest() for name, h in self._sha.items()}
        sums.update({name: file_sha256(os.path.join(self.path, name)) for name in ARRAYS if name not in sums})
        manifest = {**manifest, "format": FORMAT_VERSION, "max_token_id": self.max_token_id,
                    "arrays": {name: {"bytes": os.path.getsize(os.path.join(self.path, name)), "sha256": sums[name]}
                               for name in ARRAYS},
                    "counts": {**manifest.get("counts", {}), "documents": len(self.lengths),
                               "tokens": int(offsets[-1]), "targets": self.targets,
                               "documents_without_targets": self.untrained},
                    "dtypes": {"tokens": np.dtype(TOKEN_DTYPE).name, "target": "uint8"}}
        with open(os.path.join(self.path, STAMP), "w") as f:  # verified as written: sums of the bytes that went out
            json.dump({name: [st.st_size, st.st_mtime_ns] for name in ARRAYS
                       for st in [os.stat(os.path.join(self.path, name))]}, f)
        tmp = os.path.join(self.path, MANIFEST + ".part")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(self.path, MANIFEST))
        return manifest

    def abort(self) -> None:
        for f in (self._tokens, self._target):
            f.close()


def store_problems(path: str, manifest: dict, verify: str = "full", vocab_size: Optional[int] = None) -> list[str]:
    """What is wrong with the arrays of a prepared directory: sizes always; with
    verify="full" the sha256 sums (skipped while verified.json matches every array's size
    and modification time) and the largest token id against `vocab_size`."""
    arrays, problems = manifest.get("arrays", {}), []
    stats = {}
    for name in ARRAYS:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{name} is missing")
            continue
        st = os.stat(file)
        stats[name] = [st.st_size, st.st_mtime_ns]
        if st.st_size != arrays[name]["bytes"]:
            problems.append(f"{name} has {st.st_size} bytes, the manifest says {arrays[name]['bytes']}")
    top = manifest.get("max_token_id", -1)
    if vocab_size is not None and top >= vocab_size:
        problems.append(f"token id {top} is outside the tokenizer's vocabulary of {vocab_size}")
    if problems or verify != "full" or _stamp(path) == stats:
        return problems
    for name in ARRAYS:
        if file_sha256(os.path.join(path, name)) != arrays[name]["sha256"]:
            problems.append(f"{name} does not match its sha256 in the manifest (changed after it was written)")
    tokens = np.memmap(os.path.join(path, "tokens.bin"), dtype=TOKEN_DTYPE, mode="r") if stats["tokens.bin"][0] else []
    if len(tokens) and int(np.max(tokens)) != top:
        problems.append(f"tokens.bin's largest id is {int(np.max(tokens))}, the manifest says {top}")
    if not problems:
        try:  # a read-only cache still works; it is checked again next time
            with open(os.path.join(path, STAMP), "w") as f:
                json.dump(stats, f)
        except OSError:
            pass
    return problems


def _stamp(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, STAMP)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class PreparedDataset:
    """A prepared directory, memory-mapped: a Corpus for PackedDocs (megaft.data.packed).
    Opening it checks its arrays (`store_problems`) and raises StoreDamagedError."""

    def __init__(self, path: str, *, verify: str = "full", vocab_size: Optional[int] = None):
        if not is_complete(path):
            raise DataError(f"{path}: not a complete prepared dataset (no {MANIFEST}); "
                            "fix: run megaft-prepare with the same data settings")
        with open(os.path.join(path, MANIFEST)) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT_VERSION:
            raise DataError(f"{path}: prepared with format {self.manifest.get('format')}, this megaft "
                            f"reads {FORMAT_VERSION}; fix: delete the directory and prepare again")
        problems = store_problems(path, self.manifest, verify, vocab_size)
        if problems:
            raise StoreDamagedError(f"{path}: the prepared dataset is damaged: {'; '.join(problems)}; fix: delete "
                                    "the directory and run megaft-prepare again (megaft-train rebuilds it when the "
                                    "sources are there)")
        self.path = path
        n = self.manifest["counts"]["tokens"]
        # np.memmap refuses empty files; an empty dataset gets empty arrays.
        self.tokens = self._map("tokens.bin", TOKEN_DTYPE, n)
        self.target = self._map("target.bin", np.uint8, n)
        self.offsets = np.load(os.path.join(path, "offsets.npy"), mmap_mode="r")
        self.source = np.load(os.path.join(path, "source.npy"), mmap_mode="r")
        self.prompt_len = np.load(os.path.join(path, "prompt_len.npy"), mmap_mode="r")
        self.lengths = np.diff(self.offsets)  # 8 bytes per document, the one array held in memory

    def _map(self, name: str, dtype, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(os.path.join(self.path, name), dtype=dtype, mode="r", shape=(n,))

    def __len__(self) -> int:
        return len(self.lengths)

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, target bool) of document i, read from the mapped files."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b].astype(np.int64), self.target[a:b].astype(bool)

    def encoded(self, i: int) -> Encoded:
        """Document i as an Encoded (what encode_example returned for it)."""
        ids, target = self.doc(i)
        return Encoded(ids.tolist(), target.tolist(), int(self.prompt_len[i]))

    def to_encoded(self, weights: Optional[list[float]] = None, seed: int = 0) -> list[Encoded]:
        """Every document in memory, for PackedStream (data.packing=stream), with the
        epoch-0 mixture of `weights` applied; this one copies the data."""
        from megaft.data.sources import mixture

        order = range(len(self)) if weights is None else mixture(self.source, weights, seed, 0)
        return [self.encoded(int(i)) for i in order]
