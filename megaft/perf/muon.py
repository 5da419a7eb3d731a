"""What optim.name=muon adds to a step (megaft.optim.muon, muon_zero), for megaft.perf.time.

Muon orthogonalises each hidden 2-D weight's update with `ns_steps` quintic Newton-Schulz
iterations in bf16 on the whole matrix, in its wide orientation X [m, n] (m <= n):
A = X X^T (2 m^2 n FLOPs), B = b A + c A A (2 m^3), X <- a X + B X (2 m^2 n), so
ns_steps * (4 m^2 n + 2 m^3) FLOPs a matrix (`ns_flops`; tests/test_muon_cost.py counts the
implementation's with torch's FlopCounterMode). Where that runs:

- tp > 1: every tp rank gathers the whole update of its shards over tp and orthogonalises the
  whole matrix (the work does not shrink with tp; the gather is one all-gather of the matrix);
- ZeRO >= 1: one extra all-gather of the Muon buckets over dp (the momentum updates, the size of
  the params' gather), and each rank orthogonalises only the matrices its chunk holds (about
  1/dp of them);
- the momentum buffer lives in AdamW's exp_avg slot (its exp_avg_sq stays zero), so the state
  bytes are AdamW's.
"""
from __future__ import annotations

from megaft.config.model import ModelConfig


def hidden_matrices(m: ModelConfig) -> list[tuple[int, int]]:
    """The whole (rows, cols) of one dense block's Muon matrices: q, k, v, o, gate, up, down."""
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
    return [(q, m.dim), (kv, m.dim), (kv, m.dim), (m.dim, q), (m.ffn_dim, m.dim), (m.ffn_dim, m.dim),
            (m.dim, m.ffn_dim)]


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Newton-Schulz FLOPs of one (rows, cols) matrix (module docstring)."""
    small, large = min(rows, cols), max(rows, cols)
    return steps * (4.0 * small * small * large + 2.0 * small ** 3)


def block_ns_flops(m: ModelConfig, steps: int) -> float:
    """One dense block's Newton-Schulz FLOPs."""
    return sum(ns_flops(r, c, steps) for r, c in hidden_matrices(m))


def block_matrix_elements(m: ModelConfig) -> int:
    """One dense block's Muon elements (whole matrices)."""
    return sum(r * c for r, c in hidden_matrices(m))
