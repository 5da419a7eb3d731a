"""The policy's per-token entropy (GRPO's `entropy` metric, megaft.pref.logps.token_entropy): the
entropy of softmax over the true vocabulary (padding columns are no token), from the plain head's
logits and from the fused head's recomputed chunks alike."""
from __future__ import annotations

import dataclasses

import torch

from megaft.config.kernels import KernelsConfig
from megaft.config.model import ModelConfig
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.pref.logps import decoder_token_logps, token_entropy


def test_entropy_over_the_true_vocabulary():
    logits = torch.randn(2, 5, 12, dtype=torch.float64)
    want = torch.distributions.Categorical(logits=logits[..., :10]).entropy()
    got = token_entropy(logits, group=None, vocab_size=10)  # columns 10, 11: padding
    assert torch.allclose(got, want.float(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(token_entropy(logits, group=None, vocab_size=12), got)


def test_the_fused_head_gives_the_plain_heads_entropy():
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=37, max_seq_len=16)
    model = Decoder(cfg)
    init_params(model, cfg, seed=0, tp_rank=0, tp_size=1)
    ids = torch.randint(0, 37, (3, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    plain = decoder_token_logps(model, ids, labels, temperature=0.7, entropy=True)
    model.kernels = dataclasses.replace(KernelsConfig(), fused_linear_cross_entropy=True, ce_chunk_tokens=5)
    fused = decoder_token_logps(model, ids, labels, temperature=0.7, entropy=True)
    assert torch.allclose(plain[0], fused[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(plain[1], fused[1], rtol=1e-5, atol=1e-5) and plain[1].min() > 0
