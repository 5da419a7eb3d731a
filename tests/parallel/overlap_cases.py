"""Rank functions for the sequence-parallel ring overlap tests (spawned by test_overlap.py).

Each rank runs a column/row pair two ways on the same seeded inputs: the plain sequence-parallel
path (all-gather, F.linear, reduce-scatter: the specification) and the ring
(megaft.parallel.tensor.overlap), and compares the outputs, the input gradient and every weight
and bias gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megaft.parallel.comm import group_rank, group_size
from megaft.parallel.tensor.comm import gather_from_sp, reduce_scatter_to_sp
from megaft.parallel.tensor.overlap import ring_column, ring_row

DIM, OUTS, HIDDEN = 24, (16, 8, 8), 16


def _params(rank: int, bias: bool):
    """This rank's q/k/v-like column weights (three sharing one input), a row weight, an adapter-like
    weight reading the gathered input and a row adapter's; seeded per rank (each holds its shards)."""
    g = torch.Generator().manual_seed(11 + rank)
    cols = [torch.randn(o, DIM, generator=g) for o in OUTS]
    biases = [torch.randn(o, generator=g) if bias else None for o in OUTS]
    row, adapter, row_adapter = (torch.randn(DIM, HIDDEN, generator=g), torch.randn(HIDDEN, DIM, generator=g),
                                 torch.randn(DIM, HIDDEN, generator=g))
    return ([w.requires_grad_() for w in cols], [b if b is None else b.requires_grad_() for b in biases],
            row.requires_grad_(), adapter.requires_grad_(), row_adapter.requires_grad_())


def _pair(x, params, group, ring: bool):
    """x -> (q, k, v) column linears on the gathered x (+ an adapter on it) -> row linear (+ a row
    adapter's partial output) -> this rank's sequence shard."""
    cols, biases, row, adapter, row_adapter = params
    if ring:
        full, (q, k, v) = ring_column(x, cols, biases, group)
    else:
        full = gather_from_sp(x, group)
        q, k, v = (F.linear(full, w, b) for w, b in zip(cols, biases))
    h = q * torch.cat([k, v], dim=-1).sigmoid() + F.linear(full, adapter)
    extra = F.linear(h, row_adapter)
    if ring:
        return ring_row(h, row, group, extra=extra)
    return reduce_scatter_to_sp(F.linear(h, row) + extra, group)


def _run(group, batch: int, bias: bool, ring: bool) -> list[torch.Tensor]:
    """The pair's output and the gradients of its input and of every parameter."""
    rank = group_rank(group)
    params = _params(rank, bias)
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(batch, 3, DIM, generator=g).requires_grad_()  # this rank's 3 positions of 3 * tp
    y = _pair(x, params, group, ring)
    y.backward(torch.randn(batch, 3, DIM, generator=g))
    cols, biases, row, adapter, row_adapter = params
    return [y.detach(), x.grad, row.grad, adapter.grad, row_adapter.grad] + [w.grad for w in cols] + \
        [b.grad for b in biases if b is not None]


def compare(group) -> list[str]:
    """Ring vs plain path for batch 1 and 2, with and without biases; returns failures."""
    failures = []
    for batch in (1, 2):
        for bias in (False, True):
            ref, got = _run(group, batch, bias, ring=False), _run(group, batch, bias, ring=True)
            for i, (a, b) in enumerate(zip(got, ref)):
                # fp32 reassociation only: a chunk's GEMM may block its K sum unlike the whole GEMM's
                # (MKL picks kernels by M), the input grads sum q/k/v/adapter terms and the ranks'
                # partials in another order. Measured: <= 3.5e-7 of the tensor's largest entry
                # (6.3e-7 under ATEN_CPU_CAPABILITY=default); a wrong chunk or order is O(1).
                err = (a - b).abs().max().item() / b.abs().max().item()
                if not err <= 2e-6:
                    failures.append(f"tp={group_size(group)} batch={batch} bias={bias} tensor {i}: rel err {err:.1e}")
    return failures


def _decoder_grads(group, ring: bool, lora: bool, kv_heads: int = 4) -> tuple[torch.Tensor, dict]:
    """A tiny sequence-parallel Decoder, with LoRA on every linear (B made nonzero, so every adapter
    weight gets a gradient) or without: its loss and its trainable parameters' grads."""
    from megaft.config.lora import LoraConfig
    from megaft.config.model import ModelConfig
    from megaft.models.decoder import Decoder
    from megaft.models.init import init_params
    from megaft.peft.lora import apply_lora

    tp, rank = group_size(group), group_rank(group)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=kv_heads, ffn_dim=48, vocab_size=37,
                      max_seq_len=32, attention_bias=True, mlp_bias=True)
    model = Decoder(cfg, group=group, sequence_parallel=True, tp_overlap=ring)
    assert model.layers[0].self_attn.replicas == max(1, tp // kv_heads)
    init_params(model, cfg, seed=3, tp_rank=rank, tp_size=tp)
    if lora:
        apply_lora(model, LoraConfig(rank=4), seed=1, tp_rank=rank, tp_size=tp)
    g = torch.Generator().manual_seed(2 + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(7))
    loss = model.loss_sum(ids, ids.roll(-1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def compare_decoder(group, lora: bool, kv_heads: int = 4) -> list[str]:
    """The ring vs the plain path on a Decoder: with LoRA adapters (column adapters read the ring's
    gathered input, row adapters' partial outputs join its reduce-scatter), or with kv heads replicated
    over tp (kv_heads < tp: their weights pass through replica_sum); loss and trainable grads."""
    want_loss, want = _decoder_grads(group, False, lora, kv_heads)
    got_loss, got = _decoder_grads(group, True, lora, kv_heads)
    tag = f"tp={group_size(group)} lora={lora} kv_heads={kv_heads}"
    failures = [] if torch.allclose(got_loss, want_loss, rtol=1e-6, atol=0) else [f"{tag} loss {got_loss} {want_loss}"]
    for name, w in want.items():
        # as in compare, through a whole block: measured <= 5.2e-7 (9.6e-7 under ATEN_CPU_CAPABILITY=default)
        err = (got[name] - w).abs().max().item() / w.abs().max().item()
        if not err <= 4e-6:
            failures.append(f"{tag} grad {name}: rel err {err:.1e}")
    return failures


def run_all(rank: int, world: int) -> None:
    """tp=world over all ranks, then tp=2 groups inside the world (neighbours by group rank)."""
    import torch.distributed as dist

    world_group = dist.group.WORLD
    failures = compare(world_group) + compare_decoder(world_group, lora=True)
    failures += compare_decoder(world_group, lora=False, kv_heads=world // 2)  # 2 replicas of each kv head
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    failures += compare(pairs[rank // 2]) + compare_decoder(pairs[rank // 2], lora=True)
    assert not failures, "\n".join(failures)
