"""The teacher scored once into its top-k per target token (distill.top_k), and where it is kept.

Every document of the training corpus is scored once from its own start, its first data.seq_len
tokens (what packing=docs|none feeds the student: a document's tokens attend to it alone), at the
run's tp layout, each dp rank a share of the documents. The result is one row per scored target
token, in corpus order (document by document, token by token): the teacher's k ids, their
log-probs and the log of the tail's mass (megaft.distill.topk.TopK). A micro-batch's target tokens
find their rows through the packing plan (`rows_of`), so any shuffle, micro-batch size or layout
reads the same rows.

With distill.scores the rows are kept as megaft.pref.scores keeps reference log-probs: one
safetensors file per fingerprint (the teacher's checkpoint, the corpus's ids and targets, the
tokenizer, k, the temperature, seq_len, the precision), written atomically; a run of the same
fingerprint reads it. A file whose recorded target count, k or tokenizer differ from the run's is
refused with the fix, never overwritten.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megaft.distill.topk import TopK, teacher_topk

__all__ = ["CorpusRows", "fingerprint_parts", "load_topk", "save_topk", "score_corpus", "topk_path"]


class CorpusRows:
    """Row numbers of the scored target tokens: document d's target token j (1 <= j <= seq_len) is
    row first[d] + (targets of d in 1..j) - 1."""

    def __init__(self, corpus, seq_len: int):
        self.corpus, self.seq_len = corpus, seq_len
        counts = [int(self.targets(d)[1:].sum()) for d in range(len(corpus.lengths))]
        self.first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def targets(self, d: int) -> np.ndarray:
        """The target flags of document d's first seq_len + 1 tokens (token 0 is never predicted)."""
        return np.asarray(self.corpus.doc(d)[1][:self.seq_len + 1], dtype=bool)

    def __len__(self) -> int:
        return int(self.first[-1])

    def rows_of(self, pieces: list[list[tuple[int, int, int]]]) -> torch.Tensor:
        """[rows, seq_len] each position's row (-1 where its label is no target), from the packing
        plan's pieces (megaft.data.packed.PackedDocs.pieces)."""
        out = np.full((len(pieces), self.seq_len), -1, dtype=np.int64)
        for r, row in enumerate(pieces):
            at = 0
            for d, s, length in row:
                if s:
                    raise ValueError(f"document {d} is split over sequences (data.long_docs=split): its later "
                                     "pieces see another context than the scored one; fix: data.long_docs=truncate "
                                     "or drop, or a longer data.seq_len")
                flags = self.targets(d)[1:length + 1]
                rank = self.first[d] + np.cumsum(flags) - 1
                out[r, at:at + len(flags)] = np.where(flags, rank, -1)
                at += length
        return torch.from_numpy(out)


@torch.no_grad()
def score_corpus(teacher: Callable[[torch.Tensor], torch.Tensor], rows: CorpusRows, k: int, *, temperature: float,
                 grid, vocab_size: int) -> TopK:
    """Every scored target token's TopK (the same on every rank): this dp rank's documents through
    `teacher` (input ids [1, n] -> its tp slice of the logits), then all-gathered over dp."""
    mine = {}
    for d in range(grid.dp_rank, len(rows.corpus.lengths), grid.dp_size):
        ids, _ = rows.corpus.doc(d)
        flags = rows.targets(d)[1:]
        if not flags.any():
            continue
        n = len(flags)  # the positions whose next token is in the first seq_len + 1
        logits = teacher(torch.as_tensor(np.asarray(ids[:n], dtype=np.int64), device=grid.device)[None])
        picked = logits[0, torch.from_numpy(np.flatnonzero(flags)).to(logits.device)]
        top = teacher_topk(picked, k, temperature=temperature, group=grid.tp_group, vocab_size=vocab_size)
        mine[d] = TopK(top.ids.int().cpu(), top.logps.cpu(), top.tail.cpu())
    if grid.dp_size > 1:
        every: list[Optional[dict]] = [None] * grid.dp_size
        dist.all_gather_object(every, mine, group=grid.dp_group)
        mine = {d: t for part in every for d, t in part.items()}
    parts = [mine[d] for d in sorted(mine)]
    if not parts:
        raise ValueError("distill.top_k: the corpus has no target token to score")
    return TopK(*(torch.cat(x) for x in zip(*parts)))


def fingerprint_parts(cfg, rows: CorpusRows, tokenizer_json: str) -> dict[str, Any]:
    """What the stored top-k of `cfg`'s corpus depends on."""
    from megaft.pref.scores import NOT_NUMBERS, _checkpoint_identity, _resolved_model

    teacher = cfg.distill.teacher
    corpus = hashlib.sha256()
    for d in range(len(rows.corpus.lengths)):
        ids, target = rows.corpus.doc(d)
        corpus.update(np.asarray(ids[:rows.seq_len + 1], dtype=np.int64).tobytes())
        corpus.update(rows.targets(d).tobytes())
    return {"teacher": {"checkpoint": os.path.abspath(teacher), **_checkpoint_identity(teacher)},
            "model": repr(dataclasses.replace(_resolved_model(cfg.model), **NOT_NUMBERS)),
            "corpus_sha256": corpus.hexdigest(), "n_targets": len(rows),
            "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
            "top_k": cfg.distill.top_k, "temperature": cfg.distill.temperature, "seq_len": rows.seq_len,
            "precision": str(cfg.precision)}


def topk_path(folder: str, parts: dict[str, Any]) -> str:
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(folder, f"teacher-topk-{key}.safetensors")


def save_topk(path: str, top: TopK, parts: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file); ids as int32 (any vocabulary below 2^31)."""
    from safetensors.torch import save_file

    tensors = {"ids": top.ids.int().contiguous(), "logps": top.logps.float().contiguous(),
               "tail": top.tail.float().contiguous()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"fingerprint": json.dumps(parts, sort_keys=True)})
    os.replace(tmp, path)


def load_topk(path: str, parts: dict[str, Any]) -> Optional[TopK]:
    """The stored TopK at `path`, None when there is none; a file that does not match the run (its
    target count, k or tokenizer) raises with the fix and is left as it is."""
    if not os.path.isfile(path):
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as f:
        stored = json.loads((f.metadata() or {}).get("fingerprint", "{}"))
    tensors = load_file(path)
    ids = tensors.get("ids")
    shape = tuple(ids.shape) if ids is not None else None
    problems = []
    if shape is None or shape[0] != parts["n_targets"] or stored.get("n_targets") != parts["n_targets"]:
        problems.append(f"it holds {shape[0] if shape else 'no'} target tokens and this run's data "
                        f"{parts['n_targets']} (other data, data.seq_len or data.train_on)")
    if shape is None or shape[1:] != (parts["top_k"],) or stored.get("top_k") != parts["top_k"]:
        problems.append(f"it keeps k={shape[1] if shape and len(shape) > 1 else None} ids a token and this run "
                        f"asks distill.top_k={parts['top_k']}")
    if stored.get("tokenizer_sha256") != parts["tokenizer_sha256"]:
        problems.append("it was scored with another tokenizer (its ids are other tokens)")
    if problems:
        raise ValueError(f"distill.scores: {path} does not match this run: {'; '.join(problems)}; fix: move or delete "
                         "that file to score again (nothing is overwritten), or point distill.scores at another folder")
    return TopK(ids.long(), tensors["logps"], tensors["tail"])

