"""cluster.recompute_ops: torchtitan's op-level selective checkpointing, priced. The recomputed linears
are the ones torchtitan's policy runs again (checked by running that policy on a Llama block in torch),
and the setting changes nothing but model.recompute=selective."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from benchmarks.plan import load_cluster, torchtitan_config
from megaft.config.model import ModelConfig
from megaft.perf.op_recompute import recomputed_linears
from megaft.perf.time import step_cost

SHAPE = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, n_layers=2)


def titan_policy():
    """torchtitan's _get_custom_policy for mm (distributed/activation_checkpoint.py): per checkpointed
    call, the forward's and the recompute's mm counted apart; every even one recomputed."""
    meta = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func == torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            meta[key] += 1
            if meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        if func == torch.ops.aten._scaled_dot_product_flash_attention.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class Block(torch.nn.Module):
    """A Llama block as torchtitan writes it: separate wq, wk, wv, wo; w2(silu(w1(x)) * w3(x))."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.wq, self.wk, self.wv, self.wo = lin(m.dim, q), lin(m.dim, kv), lin(m.dim, kv), lin(q, m.dim)
        self.w1, self.w3, self.w2 = lin(m.dim, m.ffn_dim), lin(m.dim, m.ffn_dim), lin(m.ffn_dim, m.dim)
        self.m = m

    def forward(self, x):
        m, (b, s, _) = self.m, x.shape
        q = self.wq(x).view(b, s, m.n_heads, m.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, m.kv_heads, m.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, m.kv_heads, m.hd).transpose(1, 2)
        rep = m.n_heads // m.kv_heads
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        h = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        return h + self.w2(F.silu(self.w1(h)) * self.w3(h))


class MMShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops.aten.mm.default:
            self.shapes.append((args[0].shape[0], args[0].shape[1], args[1].shape[1]))
        return func(*args, **(kwargs or {}))


def test_recomputed_linears_are_the_ones_torchtitans_policy_runs_again():
    m = ModelConfig(**SHAPE)
    torch.manual_seed(0)
    block, x = Block(m), torch.randn(2, 8, m.dim, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False,
                   context_fn=lambda: create_selective_checkpoint_contexts(titan_policy()))
    with MMShapes() as mode:
        y.sum().backward()
    tokens = 16
    # the backward's mm: two per linear (input and weight gradients) and the forward mm recomputed
    grads = 2 * 7
    assert len(mode.shapes) == grads + 3
    # the recomputed forward GEMMs are (rows, n_in) x (n_in, n_out) of wk, wo and w3, in that order
    want = [(lin.rows, lin.n_in, lin.n_out) for lin in recomputed_linears(m, 0, tokens, 1)]
    assert [s for s in mode.shapes if s[0] == tokens and s in want][:3] == want
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
    assert want == [(tokens, m.dim, kv), (tokens, q, m.dim), (tokens, m.dim, m.ffn_dim)]


def test_tp_splits_the_recomputed_linears_and_moe_blocks_keep_the_attention_ones():
    m = ModelConfig(**SHAPE)
    assert [(x.n_in, x.n_out) for x in recomputed_linears(m, 0, 16, 2)] == [(64, 16), (32, 64), (64, 48)]
    moe = ModelConfig(**SHAPE, n_experts=4, top_k=2, moe_ffn_dim=32)
    assert len(recomputed_linears(moe, 0, 16, 1)) == 2


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_recompute_ops_changes_only_selective(recompute):
    h100 = dataclasses.replace(load_cluster("h100"), compiled=False)
    cfg = torchtitan_config(8, 16)
    cfg.model.recompute = recompute
    off = step_cost(cfg, h100, 8)
    on = step_cost(cfg, dataclasses.replace(h100, recompute_ops=True), 8)
    if recompute != "selective":
        assert on.step_s == off.step_s
    else:  # Llama 3.1 8B: three of seven matmuls again (wk, wo, w3) cost more than the core and the activation
        assert on.step_s > off.step_s
