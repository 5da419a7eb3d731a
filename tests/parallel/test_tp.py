"""Tensor parallelism equals the single-process model: logits, every grad, and the
vocab-parallel cross-entropy (tp=1 is the reference itself; tp=2 and tp=4 spawned)."""
import torch
import torch.nn.functional as F
from multirank import spawn

from megaft.config.model import ModelConfig
from megaft.inference.generate import full_logits
from megaft.kernels.cross_entropy.reference import vocab_parallel_cross_entropy
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from parallel import tp_cases


def test_tp2_and_tp4_match_reference():
    spawn(4, tp_cases.run_all)


def test_cross_entropy_single_rank_matches_torch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 13, generator=g, requires_grad=True)
    labels = torch.tensor([0, 12, -100, 5, 5, 1])
    got = vocab_parallel_cross_entropy(logits, labels, group=None, vocab_start=0, vocab_size=13)
    ref_logits = logits.detach().clone().requires_grad_()
    want = F.cross_entropy(ref_logits, labels, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-6)


def test_vocab_padding_is_invisible():
    """A vocabulary padded to 64 gives the same logits and loss as an unpadded one."""
    base = dict(dim=32, n_layers=1, n_heads=2, ffn_dim=32, vocab_size=21, max_seq_len=16)
    plain, padded = Decoder(ModelConfig(**base)), Decoder(ModelConfig(**base, make_vocab_size_divisible_by=64))
    for m in (plain, padded):
        init_params(m, m.cfg, seed=5, tp_rank=0, tp_size=1)
    assert padded.lm_head.weight.shape[0] == 64 and plain.lm_head.weight.shape[0] == 21
    ids = torch.randint(0, 21, (2, 10), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(full_logits(padded, ids), full_logits(plain, ids))
    assert full_logits(padded, ids).shape[-1] == 21
    torch.testing.assert_close(padded.loss_sum(ids, ids), plain.loss_sum(ids, ids))
