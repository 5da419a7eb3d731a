"""torchtitan's op-level selective activation checkpointing, priced (cluster.recompute_ops).

torchtitan's `activation_checkpoint.mode: selective` with `selective_ac_option: op` (torchtitan,
torchtitan/distributed/activation_checkpoint.py, `_get_custom_policy`) wraps each decoder block and,
counting the block's `aten.mm` calls from one in forward order, saves every odd one and recomputes
every even one ("mm_count % 2 == 0" -> PREFER_RECOMPUTE); scaled-dot-product attention and the
collectives are in its save list; every other op (norms, rotary, the activation, residual adds) is
recomputed. A Llama block calls wq, wk, wv, wo, w1, w3, w2 in that order (torchtitan's
models/llama3/model.py: three separate q/k/v projections, the MLP as w2(silu(w1(x)) * w3(x))), so
its backward runs wk, wo and w3 again, and the forward's elementwise kernels, but not the attention core.
megaft's runtime has no such mode (its selective recomputes the core and the activation): this is a
cost-model setting for runs that used it (benchmarks/plan.py's torchtitan rows). Mixture-of-experts
blocks: the attention's wk and wo only (the experts' grouped GEMMs are not `aten.mm`: assumed saved).
"""
from __future__ import annotations

from megaft.perf.gemm import Linear, linear_s
from megaft.perf.kernels_cost import GEMM_KERNELS, Pass, with_host


def recomputed_linears(m, layer: int, tokens: int, tp: int) -> list[Linear]:
    """The linears of block `layer` (megaft.config.model.ModelConfig) whose forward torchtitan's op
    policy runs again, on one tp rank for its `tokens`: the even ones of wq, wk, wv, wo[, w1, w3, w2]."""
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
    order = [Linear(tokens, m.dim, q // tp), Linear(tokens, m.dim, kv // tp), Linear(tokens, m.dim, kv // tp),
             Linear(tokens, q // tp, m.dim)]
    if not m.is_moe(layer):
        f = m.ffn_dim // tp
        order += [Linear(tokens, m.dim, f), Linear(tokens, m.dim, f), Linear(tokens, f, m.dim)]
    return order[1::2]


def op_recompute_s(m, layer: int, tokens: int, tp: int, rate: float, curve, forward: Pass | None, kc) -> float:
    """Seconds block `layer`'s backward spends recomputing under torchtitan's op policy: the
    recomputed linears' forward GEMMs (by the GEMM curve, at `rate` without one) and, with the
    kernels priced (`forward`: the block's forward Pass, kc: megaft.perf.kernels_cost.KernelCosts),
    the forward's elementwise bytes, a launch per kernel run again and the eager host's bound."""
    linears = recomputed_linears(m, layer, tokens, tp)
    gemms = sum(linear_s(lin, curve)[0] if curve is not None else lin.flops / rate for lin in linears)
    if forward is None or kc is None:
        return gemms
    # the forward's kernels less its GEMMs and core (GEMM_KERNELS), plus the recomputed GEMMs
    again = Pass(forward.nbytes, forward.kernels - GEMM_KERNELS[0] + len(linears), 0.0)
    return with_host(gemms + again.nbytes / kc.bandwidth + again.kernels * kc.gap, again, kc)
