"""Sources: JSONL and Parquet files, directories of them, mixed by weight.

A source is a path (a .jsonl/.parquet file or a directory searched recursively for
them, in sorted order) and a weight. The weight is how many times each of its
examples appears per epoch: 3 repeats every example three times, 0.5 draws half of
them (a different seeded half each epoch), 1 is the plain file. Mixing is a pure
function of (seed, epoch, which source each document came from). Nothing is
downloaded.

A Hugging Face `datasets` directory written by `save_to_disk` is read too, with
pyarrow alone (the `datasets` package is not needed): its state.json lists Arrow
IPC stream files; a DatasetDict's dataset_dict.json points at splits, of which the
"train" split is read. The Hub cache (~/.cache/huggingface) is not searched: save
the dataset to disk, or export it with `ds.to_parquet(...)`.

Records carry their location: JSONL lines are numbered from 1 as in an editor,
Parquet rows from 1 too ("FILE:ROW" in messages).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Iterator, Optional

import numpy as np

from megaft.data.errors import DataError
from megaft.data.formats import parse_record
from megaft.data.jsonl import scan_json_lines, where

EXTENSIONS = (".jsonl", ".parquet")
PARQUET_BATCH = 1024  # rows decoded at a time: bounds memory on large row groups


def source_files(path: str) -> list[str]:
    """The data files a source path names, sorted; raises DataError with the fix."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):  # datasets' DatasetDict
        if not os.path.isfile(os.path.join(path, "train", "state.json")):
            raise DataError(f"{path}: a saved DatasetDict without a 'train' split; fix: point the source "
                            "at the split's directory")
        path = os.path.join(path, "train")
    if os.path.isfile(os.path.join(path, "state.json")):  # datasets' save_to_disk
        with open(os.path.join(path, "state.json")) as f:
            return [os.path.join(path, d["filename"]) for d in json.load(f).get("_data_files", [])]
    if os.path.isdir(path):
        found = sorted(os.path.join(root, f) for root, _, files in os.walk(path)
                       for f in files if f.endswith(EXTENSIONS))
        if not found:
            raise DataError(f"{path}: directory holds no .jsonl or .parquet files; "
                            "fix: point the source at a directory of data files or at one file")
        return found
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found; fix: check the path (relative paths are "
                        "resolved from the directory the run starts in)")
    if not path.endswith(EXTENSIONS):
        raise DataError(f"{path}: unknown file type; fix: use .jsonl (one JSON object per line) "
                        "or .parquet files")
    return [path]


def scan_file(path: str, parse: Callable[[dict], dict] = parse_record, what: str = "examples"
              ) -> Iterator[tuple[int, Optional[dict], Optional[str]]]:
    """`(line, parse(record), None)` or `(line, None, problem)` for every record of a file
    (scan_jsonl's contract, Parquet rows included); `parse` raises DataError for a bad record
    (megaft.data.formats' examples by default; megaft.pref.data's pairs)."""
    if path.endswith((".parquet", ".arrow")):
        yield from _scan_parquet(path, parse)
    else:
        yield from scan_json_lines(path, parse, what)


def record_batches(path: str):
    """Record batches of a Parquet file or of an Arrow IPC stream (a `datasets` shard)."""
    if path.endswith(".arrow"):
        import pyarrow as pa

        return iter(pa.ipc.open_stream(path))
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH)


def _scan_parquet(path: str, parse: Callable[[dict], dict]) -> Iterator[tuple[int, Optional[dict], Optional[str]]]:
    try:
        batches = record_batches(path)
    except ImportError:
        yield 0, None, "reading Parquet needs pyarrow; fix: pip install pyarrow"
        return
    except Exception as e:  # pyarrow raises ArrowInvalid & co. on a broken file
        yield 0, None, f"cannot read Parquet ({e}); fix: rewrite the file with pyarrow or pandas"
        return
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            try:
                yield row, parse(parquet_row(record)), None
            except DataError as e:
                yield row, None, str(e)
    if row == 0:
        yield 0, None, "no examples (the file has no rows); fix: add at least one row"


def parquet_row(record: dict) -> dict:
    """A Parquet row without its null columns: a table mixing forms has every form's
    column in every row, null where the row does not use it."""
    return {k: v for k, v in record.items() if v is not None}


def read_source(path: str, max_lines: Optional[int] = None) -> list[dict]:
    """Every example of a source path (all its files, in order), at most `max_lines`.
    Raises DataError("FILE:LINE: problem; fix: ...") at the first malformed record."""
    examples = []
    for file in source_files(path):
        for line, ex, problem in scan_file(file):
            if problem is not None:
                raise DataError(f"{where(file, line)}: {problem}")
            examples.append(ex)
            if max_lines is not None and len(examples) >= max_lines:
                return examples
    return examples


def source_problems(path: str, limit: int = 20, tally=None, parse: Callable[[dict], dict] = parse_record,
                    what: str = "examples", is_chat: Callable[[dict], bool] = lambda ex: "messages" in ex
                    ) -> tuple[list[str], bool]:
    """(problems as "FILE:LINE: problem; fix: ...", whether any conversation was seen).
    At most `limit` problems, then one line counting the rest. Every good record is fed to
    `tally` (a megaft.data.untrained.UntrainedConversations) when given. `parse`, `what`,
    `is_chat`: how records are read (scan_file) and which are conversations (for other
    records than SFT examples: megaft.pref.data's pairs)."""
    try:
        files = source_files(path)
    except DataError as e:
        return [str(e)], False
    problems, more, chat = [], 0, False
    for file in files:
        for line, ex, problem in scan_file(file, parse, what):
            if problem is None:
                chat = chat or is_chat(ex)
                if tally is not None:
                    tally.add(file, line, ex)
            elif len(problems) < limit:
                problems.append(f"{where(file, line)}: {problem}")
            else:
                more += 1
    if more:
        problems.append(f"{path}: {more} more malformed lines not shown")
    return problems, chat


def fingerprint(path: str, block: int = 1 << 20) -> dict:
    """What identifies a file's content cheaply: size, mtime and a sha256 of its
    first and last MiB. It names the cache (a changed file means a new cache) without
    reading gigabytes at every start; the full sha256 is recorded while preparing."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(block))
        if st.st_size > block:
            f.seek(max(block, st.st_size - block))
            h.update(f.read(block))
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": h.hexdigest()}


def mixture(doc_source: np.ndarray, weights: list[float], seed: int, epoch: int) -> np.ndarray:
    """The document indices of one epoch, before shuffling: every document of source s
    floor(w_s) times, plus a seeded round(frac(w_s) * n_s) of them once more."""
    doc_source = np.asarray(doc_source)
    parts = []
    for s, w in enumerate(weights):
        docs = np.flatnonzero(doc_source == s)
        whole, frac = int(w), w - int(w)
        parts += [docs] * whole
        extra = int(round(frac * len(docs)))
        if extra:
            rng = np.random.default_rng([seed, epoch, s, 7])  # 7: apart from the shuffle's stream
            parts.append(np.sort(rng.permutation(docs)[:extra]))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
