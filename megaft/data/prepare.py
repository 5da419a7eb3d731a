"""Preparing the dataset once: worker processes, a file lock, an atomic rename.

    ds = prepare_dataset(cfg.data, init_from=cfg.model.init_from, eos_token_id=...)

returns the memory-mapped PreparedDataset of the data settings, preparing it first
when no complete directory of its key exists. Every process may call it: the first
takes an exclusive fcntl lock on `<cache_dir>/<key>.lock` and prepares, the others
block on the lock and then open what it wrote (call it before any process group
exists: a rank waiting here must not hold up a collective). The lock is flock(2),
which shared file systems (NFS v4, Lustre with flock mounts) honour across nodes.

Preparing reads the source files in order in this process (hashing every byte
for the manifest) and hands chunks of raw lines to data.prepare_workers worker
processes that parse, render and tokenize them; results are appended in order.
It writes into `<cache_dir>/.tmp-<key>-<random>` and renames that to `<key>` only
when complete, so a crash or a full disk leaves no directory that looks finished;
temporaries left by a crashed run are removed by the next one, under the lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, NamedTuple, Optional

import numpy as np
from tokenizers import Tokenizer

from megaft.config.data import DataConfig, data_sources
from megaft.data.build import build_tokenizer
from megaft.data.chat import ChatEncoder
from megaft.data.encode import encode_example
from megaft.data.errors import DataError
from megaft.data.formats import RECORD_FORMAT, parse_record
from megaft.data.jsonl import parse_example
from megaft.data.sources import fingerprint, parquet_row, record_batches, source_files, where
from megaft.data.store import PreparedDataset, PreparedWriter, StoreDamagedError, cache_key, is_complete
from megaft.data.templates import ChatTemplate, load_chat_template, tokenizer_dir_of
from megaft.data.tokenizer import special_ids
from megaft.data.untrained import UntrainedConversations

log = logging.getLogger("megaft")
CHUNK_RECORDS = 256  # records per task: large enough to amortize pickling, small for an even load
MAX_PROBLEMS = 20


class ChunkResult(NamedTuple):
    """What a worker returns for one chunk of records: concatenated ids and targets, per-document
    lengths and prompt lengths, (line, problem) of the records that failed, and the chunk's tally
    (its records' notes, merged by the caller, who knows the file)."""

    ids: np.ndarray
    target: np.ndarray
    lengths: np.ndarray
    prompt_lens: np.ndarray
    bad: list
    tally: object


class EncodeSpec(NamedTuple):
    """What a worker needs to encode records (picklable). The preparing of other record kinds
    (megaft.pref.store's pairs) passes a spec of the same methods: `identity`, `options`,
    `tally`, `encoder`."""

    tokenizer_json: str
    template: Optional[ChatTemplate]
    train_on: str
    eos_id: Optional[int]

    def identity(self) -> dict:
        """What the arrays depend on besides the source files (into the cache key)."""
        return {"record_format": RECORD_FORMAT,  # what megaft makes of the records (megaft.data.formats)
                "tokenizer_sha256": hashlib.sha256(self.tokenizer_json.encode()).hexdigest(),
                "template": template_identity(self.template), "train_on": self.train_on, "eos_id": self.eos_id}

    def options(self, cfg: DataConfig) -> dict:
        return {"train_on": self.train_on, "chat_template": cfg.chat_template, "eos_id": self.eos_id}

    def tally(self) -> UntrainedConversations:
        """The notes kept over every record (conversations with nothing to learn)."""
        return UntrainedConversations(self.train_on)

    def encoder(self) -> Callable[[list], ChunkResult]:
        """In a worker: the function that encodes a chunk of (line, raw bytes | Parquet row)."""
        tok = Tokenizer.from_str(self.tokenizer_json)
        chat = ChatEncoder(tok, self.template, self.train_on) if self.template is not None else None
        return partial(_encode_chunk, tok, chat, self.eos_id, self.train_on)


def template_identity(template: Optional[ChatTemplate]) -> Optional[dict]:
    return None if template is None else {"name": template.name, "sha256": template.sha256,
                                           "tokens": template.special_tokens}


def cache_root(cfg: DataConfig) -> str:
    """data.cache_dir, else ~/.cache/megaft/prepared (on clusters, home is shared)."""
    return os.path.abspath(os.path.expanduser(cfg.cache_dir or "~/.cache/megaft/prepared"))


def encode_spec(cfg: DataConfig, *, init_from: Optional[str] = None, eos_token_id=None,
                tok: Optional[Tokenizer] = None) -> EncodeSpec:
    """The tokenizer, template and options the data settings encode with."""
    tok = tok or build_tokenizer(cfg, init_from=init_from)
    template = load_chat_template(cfg.chat_template, tokenizer_dir_of(cfg.tokenizer, init_from))
    eos_id, _ = special_ids(tok, eos_token_id)
    return EncodeSpec(tok.to_str(), template, cfg.train_on, eos_id)


def identity(cfg: DataConfig, spec: EncodeSpec) -> dict:
    """Everything the prepared arrays depend on; its hash is the cache key. Source weights
    are not in it: they are applied when reading, so reweighting reuses the cache."""
    return {"sources": [[fingerprint(f) for f in source_files(s.path)] for s in data_sources(cfg)], **spec.identity()}


def prepared_path(cfg: DataConfig, *, init_from: Optional[str] = None, eos_token_id=None) -> str:
    """Where the prepared dataset of these settings lives (prepared or not)."""
    spec = encode_spec(cfg, init_from=init_from, eos_token_id=eos_token_id)
    return os.path.join(cache_root(cfg), cache_key(identity(cfg, spec)))


def prepare_dataset(cfg: DataConfig, *, init_from: Optional[str] = None, eos_token_id=None,
                    progress: bool = True, tok: Optional[Tokenizer] = None, spec=None) -> PreparedDataset:
    """The PreparedDataset of the data settings, prepared first if missing (module doc).
    `eos_token_id` is the checkpoint config.json's (appended to completions). `spec`: how
    records are encoded when not as SFT examples (megaft.pref.store's pairs; `tok` is then
    the spec's tokenizer). Raises DataError listing up to 20 bad records as FILE:LINE with their fix."""
    spec = spec or encode_spec(cfg, init_from=init_from, eos_token_id=eos_token_id, tok=tok)
    ident = identity(cfg, spec)
    root = cache_root(cfg)
    final = os.path.join(root, cache_key(ident))
    vocab = Tokenizer.from_str(spec.tokenizer_json).get_vocab_size() if tok is None else tok.get_vocab_size()
    opened = _open_verified(final, str(cfg.verify_store), vocab)
    if opened is not None:
        return opened
    os.makedirs(root, exist_ok=True)
    with _locked(final + ".lock"):
        # another process may have finished (or rebuilt a damaged store) while we waited
        if _open_verified(final, str(cfg.verify_store), vocab, repair=True) is None:
            _remove_stale(root, os.path.basename(final))
            tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)}-", dir=root)
            try:
                _build(cfg, spec, ident, tmp, progress)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return PreparedDataset(final, verify=str(cfg.verify_store), vocab_size=vocab)


def _open_verified(path: str, verify: str, vocab: int, *, repair: bool = False) -> Optional[PreparedDataset]:
    """The store at `path` when it is complete and intact; None when it must be built. A
    damaged one is never used: holding the lock (`repair`), it is removed with a warning
    naming what was wrong, and the caller rebuilds it from the sources (identity() has just
    read them, so they are there)."""
    if not is_complete(path):
        return None
    try:
        return PreparedDataset(path, verify=verify, vocab_size=vocab)
    except StoreDamagedError as exc:
        if repair:
            log.warning("%s; rebuilding it from the sources", exc)
            aside = tempfile.mkdtemp(prefix=f".damaged-{os.path.basename(path)}-", dir=os.path.dirname(path))
            os.rename(path, os.path.join(aside, "store"))  # out of the way at once, then deleted
            shutil.rmtree(aside, ignore_errors=True)
        return None
    except (FileNotFoundError, DataError):
        # another process, holding the lock, moved a damaged store aside between is_complete and the
        # open (a file gone, or the manifest): wait for its rebuild at the lock
        if repair:
            raise
        return None


@contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process preparing %s", path[:-len(".lock")])
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_stale(root: str, key: str) -> None:
    """Temporaries of this key from crashed runs (we hold the lock: none is live)."""
    for name in os.listdir(root):
        if name.startswith(f".tmp-{key}-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _build(cfg: DataConfig, spec: EncodeSpec, ident: dict, tmp: str, progress: bool) -> None:
    """Encode every source into `tmp` and write its manifest (the last file)."""
    from tqdm import tqdm

    sources = data_sources(cfg)
    files = [(s, f) for s, src in enumerate(sources) for f in source_files(src.path)]
    workers = cfg.prepare_workers or min(8, os.cpu_count() or 1)
    writer = PreparedWriter(tmp)
    problems, file_info = [], []
    untrained = spec.tally()  # e.g. conversations with nothing to learn (warned once)
    bar = tqdm(total=sum(os.path.getsize(f) for _, f in files), unit="B", unit_scale=True,
               desc="megaft-prepare", disable=not progress, file=sys.stderr)
    pool = None
    if workers > 1:
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(spec,))
    else:
        _init_worker(spec)
    pending: deque = deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            result, s, file = pending.popleft()
            ids, target, lengths, prompt_lens, bad, tally = result.result() if pool else result
            writer.add(ids, target, lengths, prompt_lens, s)
            untrained.merge(tally, file)
            problems.extend(f"{where(file, line)}: {p}" for line, p in bad)

    try:
        start = time.time()
        for s, file in files:
            hasher, records = hashlib.sha256(), 0
            for chunk in _chunks(file, hasher, bar):
                records += len(chunk)
                pending.append((pool.submit(_run_chunk, chunk) if pool else _run_chunk(chunk), s, file))
                drain(2 * workers)  # bounded in flight: memory stays flat on large files
                if len(problems) >= MAX_PROBLEMS:
                    break
            if records == 0:
                problems.append(f"{file}: no examples (the file is empty); fix: add at least one record")
            file_info.append({**fingerprint(file), "sha256": hasher.hexdigest(), "records": records,
                              "source": s})
            if len(problems) >= MAX_PROBLEMS:
                break
        drain(0)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    for i, src in enumerate(sources):  # a source that trains nothing is a mistake, not data
        problems += untrained.problems(src.path, [f for s, f in files if s == i])
    if problems:
        writer.abort()
        shown = problems[:MAX_PROBLEMS]
        raise DataError("cannot prepare the dataset:\n" + "\n".join(f"  {p}" for p in shown))
    manifest = writer.close({
        "key": cache_key(ident), "identity": ident, "files": file_info,
        "sources": [{"path": src.path, "files": [f["path"] for f in file_info if f["source"] == i]}
                    for i, src in enumerate(sources)],
        "options": spec.options(cfg),
        "tokenizer": {"sha256": ident["tokenizer_sha256"], "path": cfg.tokenizer},
        "template": ident["template"], "workers": workers, "seconds": round(time.time() - start, 3),
        "counts": {"records": sum(f["records"] for f in file_info), **untrained.counts()}})
    if untrained.warning():
        log.warning("megaft-prepare: %s", untrained.warning())
    log.info("prepared %d documents, %d tokens", manifest["counts"]["documents"], manifest["counts"]["tokens"])


def _chunks(file: str, hasher, bar) -> Iterator[list]:
    """Chunks of (line, raw bytes) of a JSONL file or (row, dict) of a Parquet/Arrow file,
    hashing the file's bytes on the way."""
    chunk: list = []
    if file.endswith((".parquet", ".arrow")):
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                hasher.update(block)
        row = 0
        for batch in record_batches(file):
            for record in batch.to_pylist():
                row += 1
                chunk.append((row, record))
                if len(chunk) == CHUNK_RECORDS:
                    yield chunk
                    chunk = []
        bar.update(os.path.getsize(file))
    else:
        with open(file, "rb") as f:
            for line, raw in enumerate(f, start=1):
                hasher.update(raw)
                bar.update(len(raw))
                if raw.strip():
                    chunk.append((line, raw))
                    if len(chunk) == CHUNK_RECORDS:
                        yield chunk
                        chunk = []
    if chunk:
        yield chunk


_STATE: dict = {}


def _init_worker(spec) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker = one core
    _STATE["encode"] = spec.encoder()


def _run_chunk(chunk: list) -> ChunkResult:
    return _STATE["encode"](chunk)


def decoded(payload) -> str:
    """A JSONL line's text (DataError naming the fix when it is not UTF-8)."""
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"not valid UTF-8 ({e}); fix: re-encode the file as UTF-8") from None


def _encode_chunk(tok: Tokenizer, chat: Optional[ChatEncoder], eos_id: Optional[int], train_on: str,
                  chunk: list) -> ChunkResult:
    """Encode one chunk of SFT examples; the tally counts its conversations that train
    nothing (by line; the caller knows the file)."""
    ids, target, lengths, prompt_lens, bad = [], [], [], [], []
    tally = UntrainedConversations(train_on)
    for line, payload in chunk:
        try:
            ex = parse_example(decoded(payload)) if isinstance(payload, bytes) else parse_record(parquet_row(payload))
            enc = encode_example(tok, ex, eos_id, chat)
        except DataError as e:
            bad.append((line, str(e)))
            continue
        tally.add("", line, ex)
        ids += enc.ids
        target += enc.target
        lengths.append(len(enc.ids))
        prompt_lens.append(enc.prompt_len)
    return chunk_result(ids, target, lengths, prompt_lens, bad, tally)


def chunk_result(ids: list, target: list, lengths: list, prompt_lens: list, bad: list, tally) -> ChunkResult:
    return ChunkResult(np.asarray(ids, dtype=np.uint32), np.asarray(target, dtype=np.uint8),
                       np.asarray(lengths, dtype=np.int64), np.asarray(prompt_lens, dtype=np.int32), bad, tally)
