"""Rank functions for the tensor-parallel equivalence tests (spawned by test_tp.py).

Every rank builds the same seeded unsharded reference model and inputs, runs the
sharded model and compares its shard of the logits and of every parameter grad.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megaft.config.model import ModelConfig
from megaft.inference.generate import full_logits
from megaft.kernels.cross_entropy.reference import vocab_parallel_cross_entropy
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.parallel.comm import group_rank, group_size, split
from megaft.parallel.grid import ParallelGrid
from megaft.parallel.tensor.grads import sync_sequence_parallel_grads
from megaft.parallel.tensor.shard import local_from_full

# fp32; the sharded model sums partial products in a different order than the
# reference matmul (split K in row-parallel layers), so equality holds to rounding.
RTOL, ATOL = 1e-5, 1e-5

# Odd vocabulary (37: no tp divides it), GQA (8 query heads over 4 kv heads); the
# second case adds tied embeddings, biases and a vocabulary padded to 8 * tp.
CASES = [
    dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=48, vocab_size=37, max_seq_len=32),
    dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=48, vocab_size=29, max_seq_len=32,
         tie_embeddings=True, attention_bias=True, mlp_bias=True, make_vocab_size_divisible_by=8),
]


def _inputs(vocab: int, seq: int):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (3, seq), generator=g)
    labels = torch.randint(0, vocab, (3, seq), generator=g)
    labels[0, :4] = -100  # prompt tokens that do not count
    return ids, labels


def _model_grads(model, ids, labels, n_targets):
    (model.loss_sum(ids, labels) / n_targets).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def compare_model(grid: ParallelGrid, case: dict, sequence_parallel: bool, seq: int,
                  tp_overlap: bool = False) -> list[str]:
    """Logits and every parameter grad of the tp model vs the reference; returns failures.
    `tp_overlap`: parallel.tp_overlap=ring (megaft.parallel.tensor.overlap)."""
    cfg = ModelConfig(**case)
    ids, labels = _inputs(cfg.vocab_size, seq)
    n = int((labels != -100).sum())
    ref = Decoder(cfg)
    init_params(ref, cfg, seed=3, tp_rank=0, tp_size=1)
    model = Decoder(cfg, group=grid.tp_group, sequence_parallel=sequence_parallel, tp_overlap=tp_overlap)
    assert model.layers[0].mlp.down_proj.ring == tp_overlap  # the ring really runs
    init_params(model, cfg, seed=3, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    failures = []
    tag = f"tp={grid.tp_size} sp={sequence_parallel} ring={tp_overlap} case={case} seq={seq}"
    try:
        torch.testing.assert_close(full_logits(model, ids), full_logits(ref, ids), rtol=RTOL, atol=ATOL)
    except AssertionError as e:
        failures.append(f"{tag} logits: {e}")
    ref_grads = _model_grads(ref, ids, labels, n)
    _model_grads(model, ids, labels, n)
    sync_sequence_parallel_grads(list(model.parameters()), grid.tp_group)
    for name, p in model.named_parameters():
        want = local_from_full(ref_grads[name], p, grid.tp_rank, grid.tp_size)
        try:
            torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            failures.append(f"{tag} grad {name}: {e}")
    return failures


def compare_cross_entropy(grid: ParallelGrid) -> list[str]:
    """vocab_parallel_cross_entropy vs F.cross_entropy: values and logits grads, with
    padded columns (vocab 37 padded to a multiple of tp) and ignored labels."""
    tp, rank, vocab = group_size(grid.tp_group), group_rank(grid.tp_group), 37
    padded = -(-vocab // tp) * tp
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(10, vocab, generator=g, dtype=torch.float64).float() * 3
    labels = torch.randint(0, vocab, (10,), generator=g)
    labels[[1, 6]] = -100
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, labels, reduction="none")
    (want * torch.arange(1.0, 11.0)).sum().backward()
    # Padding columns hold garbage on purpose: they must not matter.
    padded_logits = torch.cat([logits, torch.full((10, padded - vocab), 50.0)], dim=1)
    local = split(padded_logits, -1, grid.tp_group).requires_grad_()
    got = vocab_parallel_cross_entropy(local, labels, group=grid.tp_group, vocab_start=rank * (padded // tp),
                                       vocab_size=vocab)
    (got * torch.arange(1.0, 11.0)).sum().backward()
    failures = []
    try:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        grad_full = torch.cat([full.grad, torch.zeros(10, padded - vocab)], dim=1)
        torch.testing.assert_close(local.grad, split(grad_full, -1, grid.tp_group), rtol=1e-6, atol=1e-6)
    except AssertionError as e:
        failures.append(f"cross-entropy tp={tp}: {e}")
    return failures


def run_all(rank: int, world: int) -> None:
    """On 4 ranks: tp=4 and tp=2 (x dp=2) grids; every case, with and without sequence
    parallel (and with it, the ring overlap), a sequence length tp divides and one it does not
    (padded internally)."""
    failures = []
    for tp in (world, world // 2):
        grid = ParallelGrid.build(tp=tp, dp=world // tp, pp=1, device="cpu")
        failures += compare_cross_entropy(grid)
        for case in CASES:
            for sp, ring in ((False, False), (True, False), (True, True)):
                for seq in (12, 9):
                    failures += compare_model(grid, case, sp, seq, tp_overlap=ring)
    assert not failures, "\n".join(failures)
