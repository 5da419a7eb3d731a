"""`verify.shrink=auto`: the smallest model that keeps every constraint of the layout.

Kept: the head counts (tp must divide query and kv heads), the number of blocks each
virtual pipeline stage holds (one per stage, or `parallel.pp_layers` as given), the
vocabulary and its padding (`make_vocab_size_divisible_by` × tp), the sequence length,
biases, tying and RoPE settings, and both kinds of layer of a model with sliding-window
and full-attention layers (when it keeps two or more). Shrunk: the number of layers, head_dim (8), the
hidden size (heads × 8) and the MLP width (2 × hidden, rounded up to a multiple of tp; a
mixture of experts keeps its experts and top-k, every shrunk block a mixture, each expert and
the shared one that wide).
A shrunk model is randomly initialized (the checkpoint's weights have other shapes);
its tokenizer stays the checkpoint's.
"""
from __future__ import annotations

import copy

from megaft.config import Config

HEAD_DIM = 8  # the smallest even head size RoPE and every kernel accept


def shrink(cfg: Config) -> Config:
    """A shrunk copy of a resolved `cfg` (see the module docstring)."""
    out = copy.deepcopy(cfg)
    m, par = out.model, out.parallel
    m.n_layers = sum(par.pp_layers) if par.pp_layers else par.pp * par.vpp
    m.layer_types = shrink_layer_types(m.layer_types, m.n_layers)
    m.head_dim = HEAD_DIM
    m.dim = m.n_heads * HEAD_DIM
    tp = max(par.tp, 1)
    m.ffn_dim = -(-2 * m.dim // tp) * tp
    if m.n_experts > 0:  # every shrunk block a mixture, the experts and top-k kept, each expert shrunk
        m.moe_ffn_dim = m.ffn_dim if m.moe_ffn_dim else None
        m.shared_expert_ffn_dim = m.ffn_dim if m.shared_expert_ffn_dim else 0
        m.decoder_sparse_step, m.mlp_only_layers = 1, []
    if m.init_from:
        out.data.tokenizer = out.data.tokenizer or m.init_from
        m.init_from = None
    return out


def shrink_layer_types(types, n: int):
    """The first `n` layer types, the last made the kind the first `n` miss (when n > 1), so a
    model with sliding and full-attention layers keeps both in the shrunk model."""
    if types is None:
        return None
    out = list(types[:n]) + [types[-1]] * max(0, n - len(types))
    missing = [t for t in dict.fromkeys(types) if t not in out]
    if missing and n > 1:
        out[-1] = missing[0]
    return out
