"""summary.json's attention record names the packed-documents kernel that actually runs: rows
with a shared prompt (Docs.prefix_ids, pref.share_prompt) never take flash-attn's varlen kernel,
so their record is flex_attention or sdpa_mask even where flash-attn is installed. On the CPU
flash-attn never runs: the decision is checked with flash_available patched True."""
from __future__ import annotations

import torch

import megaft.models.attention.documents as docs_mod
from megaft.config.model import ModelConfig
from megaft.models.attention.documents import attend, kernel_name
from megaft.models.attention.gqa import attention_record
from megaft.pref.data import Pair
from megaft.pref.packing import pack_pairs

CPU = torch.device("cpu")
PAIRS = [Pair([5, 6, 7], [8, 9, 1], [10, 1]), Pair([11], [12, 1], [13, 14, 15, 1])]


def _attend_runs_varlen(monkeypatch, docs) -> bool:
    """Whether `attend` calls the varlen kernel for `docs` (flash-attn pretended installed)."""
    called = []

    def varlen(q, k, v, d, window, fn=None):
        called.append(True)
        return torch.zeros_like(q)

    monkeypatch.setattr(docs_mod, "varlen_attend", varlen)
    b, s = docs.doc_ids.shape
    q = k = v = torch.randn(b, 2, s, 4)
    attend(q, k, v, docs, None, False)
    return bool(called)


def test_a_shared_prefix_is_not_recorded_as_flash_varlen(monkeypatch):
    monkeypatch.setattr(docs_mod, "flash_available", lambda device: True)
    plain = pack_pairs(PAIRS, 32, 0, share_prompt=False).docs
    shared = pack_pairs(PAIRS, 32, 0, share_prompt=True).docs
    assert plain.prefix_ids is None and shared.prefix_ids is not None
    # the record follows what attend runs
    assert _attend_runs_varlen(monkeypatch, plain) and kernel_name(CPU) == "flash_attn_varlen"
    assert not _attend_runs_varlen(monkeypatch, shared)
    assert kernel_name(CPU, shared_prefix=True) == "sdpa_mask"
    cfg = ModelConfig(vocab_size=8)
    record = dict(packing="docs", cp=1, seq_len=16, device=CPU)
    assert attention_record(cfg, **record) == "flash_attn_varlen"
    assert attention_record(cfg, **record, shared_prefix=True) == "sdpa_mask"
    monkeypatch.setattr(docs_mod, "flex_available", lambda device: True)  # on CUDA: flex
    assert kernel_name(CPU, shared_prefix=True) == "flex_attention"
    assert kernel_name(CPU) == "flash_attn_varlen"


def test_without_flash_the_shared_prefix_changes_nothing():
    assert kernel_name(CPU, shared_prefix=True) == kernel_name(CPU) == "sdpa_mask"
