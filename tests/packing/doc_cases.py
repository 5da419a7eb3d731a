"""Shared by the packed-document tests: a tiny model and documents packed two ways.

The reference of a packed batch is each document run through the model alone (one row,
plain causal attention, positions from 0): its summed token loss and its gradients. A
packed row must give exactly that (up to fp32 summation order), whatever the layout.
"""
from __future__ import annotations

import torch

from megaft.config.model import ModelConfig
from megaft.data.encode import Encoded
from megaft.data.packed import EncodedCorpus, PackedDocs
from megaft.models.attention.documents import Docs
from megaft.models.decoder import Decoder
from megaft.models.init import init_params

SEQ = 24  # packed row length: several documents per row
LENGTHS = [5, 9, 3, 12, 7, 4, 11, 6, 8, 2]  # tokens per document (all <= SEQ: none split)
VOCAB = 37


def model_config(**kw) -> ModelConfig:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB, max_seq_len=64)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def documents(seed: int = 0) -> list[Encoded]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
        out.append(Encoded(ids, [True] * n))
    return out


def packed(seed: int = 0, rows: int = 4):
    """(input_ids, labels, Docs) of the first global batch of `rows` packed rows, and the
    documents (ids, labels) each row holds, in order."""
    stream = PackedDocs(EncodedCorpus(documents(seed)), SEQ, seed=3, pad_id=0, packing="docs")
    batch = stream.doc_batch(0, rows)
    pieces = []
    for r in range(rows):
        row = []
        for d in batch.doc_ids[r].unique().tolist():
            cols = (batch.doc_ids[r] == d).nonzero().flatten()
            labels = batch.labels[r, cols]
            if (labels != -100).any():  # padding is a segment too, with no loss
                row.append((batch.input_ids[r, cols], labels))
        pieces.append(row)
    return batch.input_ids, batch.labels, Docs(batch.position_ids, batch.doc_ids), pieces


def full_model(cfg: ModelConfig, seed: int = 5) -> Decoder:
    model = Decoder(cfg)
    init_params(model, cfg, seed=seed, tp_rank=0, tp_size=1)
    return model


def reference(model: Decoder, pieces) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed token loss of every document run alone, and the gradients of that sum."""
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for row in pieces:
        for ids, labels in row:
            loss = model.loss_sum(ids[None], labels[None])
            loss.backward()
            total += loss.detach().double()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}
