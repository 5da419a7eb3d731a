"""Preference pairs in the prepared store: tokenized once, memory-mapped by every rank.

    store = prepare_pairs(cfg.data, init_from=..., eos_token_id=...)
    pairs = StoredPairs(store)            # pairs[i] -> Pair, as TRL's DPOTrainer tokenizes it

The store is megaft.data.prepare's (the same lock, workers, atomic rename, manifest with
sha256 sums, damage checks and rebuilding), with three documents per pair, back to back:
the prompt (no targets), the chosen and the rejected completion (every token a target);
source.npy names each pair's data.sources entry. Its cache key has `"kind": "pairs"` and
the pairs' own record format, so an SFT store of the same files is another directory.
The pairs are stored whole: data.seq_len cuts them when read (as TRL's max_length does at
collation), so one store serves every sequence length.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import partial
from typing import Callable, NamedTuple, Optional

import numpy as np
from tokenizers import Tokenizer

from megaft.config.data import DataConfig
from megaft.data.build import build_tokenizer
from megaft.data.errors import DataError
from megaft.data.prepare import (
    ChunkResult,
    cache_root,
    chunk_result,
    decoded,
    identity,
    prepare_dataset,
    template_identity,
)
from megaft.data.sources import parquet_row
from megaft.data.store import PreparedDataset, cache_key
from megaft.data.templates import ChatTemplate, load_chat_template, tokenizer_dir_of
from megaft.data.tokenizer import special_ids
from megaft.pref.data import Pair, encode_record, parse_pair

log = logging.getLogger(__name__)

# What megaft makes of a pair record (megaft.pref.data); a change that alters the ids bumps it.
PAIR_FORMAT = 1
SHOWN = 3


class PairTokenizer(NamedTuple):
    """The tokenizer and chat template pairs are encoded with, and the special ids."""

    tok: Tokenizer
    template: Optional[ChatTemplate]
    eos_id: Optional[int]
    pad_id: int
    eos_token: Optional[str]  # appended to text completions, as TRL appends tokenizer.eos_token


def pair_tokenizer(data: DataConfig, *, init_from: Optional[str], eos_token_id=None) -> PairTokenizer:
    """The run's tokenizer and template. The eos text TRL appends to each text answer is the
    tokenizer's eos_token (tokenizer_config.json's, e.g. Llama 3.1's <|eot_id|>, where
    config.json lists <|end_of_text|> first), else config.json's eos. transformers' tokenizer
    always reads that text as its one token (a special added token); a bare tokenizer.json may
    not, so make it so here too."""
    tok = build_tokenizer(data, init_from=init_from)
    template = load_chat_template(data.chat_template, tokenizer_dir_of(data.tokenizer, init_from))
    eos_id, pad_id = special_ids(tok, eos_token_id)
    eos_token = template.special_tokens.get("eos_token") if template is not None else None
    if eos_token is None and eos_id is not None:
        eos_token = tok.id_to_token(eos_id)
    if eos_token is not None and tok.token_to_id(eos_token) is not None and \
            tok.encode(eos_token, add_special_tokens=False).ids != [tok.token_to_id(eos_token)]:
        tok.add_special_tokens([eos_token])
    return PairTokenizer(tok, template, eos_id, pad_id, eos_token)


class PromptCuts:
    """The tally of a pair store: pairs read, and those whose tokenized prompt is not a prefix
    of prompt + completion (TRL's warning; the completion starts where they diverge)."""

    def __init__(self):
        self.pairs = 0
        self.cut = 0
        self.first: list[tuple[str, int]] = []

    def merge(self, other: "PromptCuts", file: Optional[str] = None) -> None:
        self.pairs += other.pairs
        self.cut += other.cut
        self.first = (self.first + [(file or f, line) for f, line in other.first])[:SHOWN]

    def counts(self) -> dict:
        return {"pairs": self.pairs, "prompts_cut": self.cut}

    def warning(self) -> Optional[str]:
        if not self.cut:
            return None
        return (f"in {self.cut} of {self.pairs} pairs ({', '.join(f'{f}:{n}' for f, n in self.first)}"
                f"{', ...' if self.cut > len(self.first) else ''}) the tokenized prompt is not a prefix of prompt + "
                "completion (the template writes the prompt alone differently, or tokens merge across the "
                "boundary); as in TRL, the completion starts where they diverge")

    def problems(self, path: str, files: list[str]) -> list[str]:
        return []


class PairSpec(NamedTuple):
    """How pairs are encoded (megaft.data.prepare.EncodeSpec's methods, picklable)."""

    tokenizer_json: str
    template: Optional[ChatTemplate]
    eos_token: Optional[str]

    def identity(self) -> dict:
        return {"kind": "pairs", "pair_format": PAIR_FORMAT,
                "tokenizer_sha256": hashlib.sha256(self.tokenizer_json.encode()).hexdigest(),
                "template": template_identity(self.template), "eos_token": self.eos_token}

    def options(self, cfg: DataConfig) -> dict:
        return {"kind": "pairs", "chat_template": cfg.chat_template, "eos_token": self.eos_token}

    def tally(self) -> PromptCuts:
        return PromptCuts()

    def encoder(self) -> Callable[[list], ChunkResult]:
        return partial(_encode_pairs, Tokenizer.from_str(self.tokenizer_json), self.template, self.eos_token)


def _encode_pairs(tok: Tokenizer, template: Optional[ChatTemplate], eos_token: Optional[str],
                  chunk: list) -> ChunkResult:
    """Encode a chunk of pair records: three documents each (prompt, chosen, rejected)."""
    ids, target, lengths, prompt_lens, bad = [], [], [], [], []
    tally = PromptCuts()
    for line, payload in chunk:
        try:
            if isinstance(payload, bytes):
                try:
                    obj = json.loads(decoded(payload))
                except json.JSONDecodeError as e:
                    raise DataError(f"invalid JSON ({e}); fix: write one complete JSON object per line") from None
            else:
                obj = parquet_row(payload)
            pair, cut = encode_record(parse_pair(obj), tok, template, eos_token)
        except DataError as e:
            bad.append((line, str(e)))
            continue
        tally.pairs += 1
        if cut:
            tally.cut += 1
            if len(tally.first) < SHOWN:
                tally.first.append(("", line))
        for part, is_target in ((pair.prompt_ids, 0), (pair.chosen_ids, 1), (pair.rejected_ids, 1)):
            ids += part
            target += [is_target] * len(part)
            lengths.append(len(part))
            prompt_lens.append(len(pair.prompt_ids))
    return chunk_result(ids, target, lengths, prompt_lens, bad, tally)


def prepare_pairs(data: DataConfig, *, init_from: Optional[str] = None, eos_token_id=None,
                  progress: bool = True, tokenizer: Optional[PairTokenizer] = None) -> PreparedDataset:
    """The pair store of data.path / data.sources, prepared first when missing (every rank may
    call it: one prepares under the lock, the others wait and open it)."""
    tokenizer = tokenizer or pair_tokenizer(data, init_from=init_from, eos_token_id=eos_token_id)
    spec = PairSpec(tokenizer.tok.to_str(), tokenizer.template, tokenizer.eos_token)
    store = prepare_dataset(data, progress=progress, tok=tokenizer.tok, spec=spec)
    if store.manifest.get("options", {}).get("kind") != "pairs" or len(store) % 3:
        raise DataError(f"{store.path}: not a store of preference pairs; fix: delete it and prepare again")
    return store


def pairs_store_path(data: DataConfig, *, init_from: Optional[str] = None, eos_token_id=None) -> str:
    """Where the pair store of these settings lives (prepared or not): what prepare_pairs opens."""
    tokenizer = pair_tokenizer(data, init_from=init_from, eos_token_id=eos_token_id)
    spec = PairSpec(tokenizer.tok.to_str(), tokenizer.template, tokenizer.eos_token)
    return os.path.join(cache_root(data), cache_key(identity(data, spec)))


class StoredPairs:
    """The pairs of a store, read on demand: `pairs[i]` is pair i as a Pair; `lengths` [pairs,
    3] the prompt, chosen and rejected lengths; `source` [pairs] each one's data.sources entry;
    pair i's tokens at tokens[offsets[3i]:offsets[3i+3]] (prompt, chosen, rejected)."""

    def __init__(self, store: PreparedDataset):
        self.store = store
        self.offsets, self.tokens = store.offsets, store.tokens
        self.lengths = np.asarray(store.lengths).reshape(-1, 3)
        self.source = np.asarray(store.source[0::3])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Pair:
        offsets, tokens = self.store.offsets, self.store.tokens
        a, b, c, d = (int(offsets[3 * i + k]) for k in range(4))
        return Pair(*(tokens[x:y].astype(np.int64).tolist() for x, y in ((a, b), (b, c), (c, d))))
