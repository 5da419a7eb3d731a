"""GEMM time by shape: what one matmul of (m, n, k) costs on a cluster's device.

One fraction of the peak for a whole model's FLOPs (`cluster.matmul_fraction`) makes a small
model's skinny GEMMs as fast as a large one's; cuBLAS does not. A GEMM C[m, n] = A[m, k] B[k, n]
runs as output tiles of tile_m x tile_n, one per streaming multiprocessor at a time, so it takes
ceil(tiles / sms) waves and a last, partly idle wave costs a full one (NVIDIA's "Matrix
Multiplication Background User's Guide": tile and wave quantization). Each full wave runs at the
largest fraction of the dense peak a GEMM reaches on the device (`ceiling`: the maximum
achievable matmul FLOPS over the datasheet peak); a GEMM with little work per byte is bound by
HBM instead (reads A and B, writes C once). So:

    seconds = max(2 * waves * sms * tile_m * tile_n * k / (peak * ceiling),
                  (m*k + k*n + m*n) * element_bytes / hbm_bandwidth)

The parameters live per cluster preset (conf/cluster/, `gemm_*` fields), each with its source.
A preset without them (gemm_sms = 0), or a run at fp32 (the ceilings are measured bf16 GEMMs),
prices every FLOP at `matmul_fraction`, as before.

Not modelled: cuBLAS's smaller tiles, split-K and stream-K for GEMMs of fewer tiles than SMs
(such a GEMM is priced as one wave of large tiles: pessimistic for a small m x n with a deep k;
the planner's GEMMs have thousands of token rows), and per-kernel launch overhead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional


@dataclass(frozen=True)
class GemmCurve:
    """A device's GEMM efficiency curve (rates in FLOP/s and bytes/s)."""

    ceiling: float  # fraction of the dense peak a large, wave-filling GEMM reaches
    tile_m: int  # output tile of one thread block, rows
    tile_n: int  # output tile of one thread block, columns
    sms: int  # streaming multiprocessors: tiles run `sms` at a time
    peak: float  # dense peak FLOP/s at the compute precision
    hbm: float  # device memory bandwidth, bytes/s
    element_bytes: int  # bytes per element of A, B and C (bf16 or fp16: 2)

    @classmethod
    def of(cls, cluster, precision: str, peak_tflops: float, hbm_tbps: float) -> Optional["GemmCurve"]:
        """The curve of a cluster preset (megaft.config.cluster.ClusterConfig) at `precision`, or None
        (every FLOP at matmul_fraction) when the preset has none (gemm_sms = 0) or the precision is
        fp32: the presets' ceilings are measured bf16 tensor-core GEMMs, which say nothing of fp32's."""
        if cluster.gemm_sms <= 0 or precision not in ("bf16", "fp16"):
            return None
        return cls(cluster.gemm_ceiling, cluster.gemm_tile_m, cluster.gemm_tile_n, cluster.gemm_sms,
                   peak_tflops * 1e12, hbm_tbps * 1e12, 2)


@lru_cache(maxsize=4096)  # a planner search asks for the same few shapes thousands of times
def gemm_s(m: int, n: int, k: int, curve: GemmCurve, groups: int = 1) -> float:
    """Seconds of one GEMM C[m, n] = A[m, k] B[k, n] (FLOPs 2mnk), or of one grouped GEMM of `groups`
    such products (a mixture's experts, megaft.kernels.grouped_gemm: their tiles share the waves)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    waves = math.ceil(groups * math.ceil(m / curve.tile_m) * math.ceil(n / curve.tile_n) / curve.sms)
    compute = 2.0 * waves * curve.sms * curve.tile_m * curve.tile_n * k / (curve.peak * curve.ceiling)
    memory = groups * (m * k + k * n + m * n) * curve.element_bytes / curve.hbm
    return max(compute, memory)


def efficiency(m: int, n: int, k: int, curve: GemmCurve) -> float:
    """The fraction of the dense peak a GEMM of (m, n, k) runs at under `curve`."""
    return 2.0 * m * n * k / curve.peak / gemm_s(m, n, k, curve)


@dataclass(frozen=True)
class Linear:
    """`count` linear layers y[rows, n_out] = x[rows, n_in] W^T (count > 1: a mixture's local experts,
    one grouped GEMM), as one rank computes them."""

    rows: int
    n_in: int
    n_out: int
    count: int = 1

    @property
    def flops(self) -> float:
        """Forward FLOPs."""
        return 2.0 * self.rows * self.n_in * self.n_out * self.count


def linear_s(lin: Linear, curve: GemmCurve) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of `lin`: y = x W^T is (rows, n_out, n_in);
    dx = dy W is (rows, n_in, n_out); dW = dy^T x is (n_out, n_in, rows), the tokens its depth."""
    c = lin.count
    return (gemm_s(lin.rows, lin.n_out, lin.n_in, curve, c), gemm_s(lin.rows, lin.n_in, lin.n_out, curve, c),
            gemm_s(lin.n_out, lin.n_in, lin.rows, curve, c))


def block_linears(m, layer: int, tokens: int, tp: int, ep: int = 1) -> list[Linear]:
    """The linears of decoder block `layer` (megaft.config.model.ModelConfig) on one rank of tp
    for its `tokens`, Megatron-fused (q/k/v one GEMM, gate/up one GEMM), split by tp as their
    FLOPs are (megaft.perf.counts). Multi-head latent attention is not listed (its FLOPs are
    priced at matmul_fraction); a mixture of experts lists each local expert with its share of
    the ep group's routed rows (uniform routing) and the shared expert (the router, [E, dim], is
    too small to matter and stays at matmul_fraction)."""
    out = []
    if not m.mla:
        q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
        out += [Linear(tokens, m.dim, (q + 2 * kv) // tp), Linear(tokens, q // tp, m.dim)]
    if not m.is_moe(layer):
        return out + [Linear(tokens, m.dim, 2 * m.ffn_dim // tp), Linear(tokens, m.ffn_dim // tp, m.dim)]
    experts = m.n_experts // ep
    rows = max(1, tokens * ep * m.top_k // m.n_experts)  # each local expert's rows from the ep group
    out += [Linear(rows, m.dim, 2 * m.expert_ffn // tp, experts), Linear(rows, m.expert_ffn // tp, m.dim, experts)]
    if m.shared_expert_ffn_dim:
        s = m.shared_expert_ffn_dim
        out += [Linear(tokens, m.dim, 2 * s // tp), Linear(tokens, s // tp, m.dim)]
    return out
