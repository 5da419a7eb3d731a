"""One representative forward + backward call per kernel op, shaped like the run's model.

:mod:`megaft.kernels.autotune` times every available backend of an op on its
:class:`Case` and checks each against torch first. A case makes fresh, seeded inputs
(``make``) and runs one op call with its backward on a backend (``step``), returning
the output and the input gradients: what the model runs per micro-batch and layer.

Shapes come from the model config and the parallel layout: ``tokens`` of one
micro-batch (capped: a larger batch only scales the work, not which backend wins),
the hidden size, the tp-local heads, FFN width and vocabulary shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MAX_TOKENS = 8192  # tokens per timed call (longer batches scale time, not the ranking)
MAX_CE_TOKENS = 4096  # cross-entropy: [tokens, vocab shard] logits and grads stay a few GB


@dataclass(frozen=True)
class Case:
    """An op's representative call: ``make(device, dtype)`` -> fresh inputs,
    ``step(backend, inputs)`` -> [output, input grads...] (forward + backward)."""
    op: str
    shape: tuple[tuple[str, int], ...]  # named sizes: the cache key and the log
    make: Callable[[torch.device, torch.dtype], tuple]
    step: Callable[[str, tuple], list[torch.Tensor]]


def _randn(gen: torch.Generator, *shape, device, dtype, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    # drawn on CPU from one seeded generator: every backend sees the same values
    t = (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(grad)


def _backward(out, leaves, dy) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    dys = dy if isinstance(dy, tuple) else (dy,)
    grads = torch.autograd.grad(outs, leaves, dys)  # no .grad accumulation across timed reps
    return [o.detach() for o in outs] + list(grads)


def rmsnorm_case(tokens: int, dim: int, eps: float = 1e-5) -> Case:
    def make(device, dtype):
        gen = torch.Generator().manual_seed(0)
        return (_randn(gen, tokens, dim, device=device, dtype=dtype, grad=True),
                _randn(gen, dim, device=device, dtype=dtype, grad=True),
                _randn(gen, tokens, dim, device=device, dtype=dtype))

    def step(backend, inputs):
        from megaft.kernels.rmsnorm import rmsnorm

        x, w, dy = inputs
        return _backward(rmsnorm(x, w, eps, backend), (x, w), dy)

    return Case("rmsnorm", (("tokens", tokens), ("dim", dim)), make, step)


def rope_case(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> Case:
    def make(device, dtype):
        gen = torch.Generator().manual_seed(0)
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (_randn(gen, batch, heads, seq, head_dim, device=device, dtype=dtype, grad=True),
                _randn(gen, batch, kv_heads, seq, head_dim, device=device, dtype=dtype, grad=True),
                emb.cos().to(device), emb.sin().to(device),
                _randn(gen, batch, heads, seq, head_dim, device=device, dtype=dtype),
                _randn(gen, batch, kv_heads, seq, head_dim, device=device, dtype=dtype))

    def step(backend, inputs):
        from megaft.kernels.rope import rope

        q, k, cos, sin, dq, dk = inputs
        return _backward(rope(q, k, cos, sin, backend), (q, k), (dq, dk))

    shape = (("batch", batch), ("seq", seq), ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim))
    return Case("rope", shape, make, step)


def swiglu_case(tokens: int, ffn: int) -> Case:
    def make(device, dtype):
        gen = torch.Generator().manual_seed(0)
        return tuple(_randn(gen, tokens, ffn, device=device, dtype=dtype, grad=i < 2) for i in range(3))

    def step(backend, inputs):
        from megaft.kernels.swiglu import swiglu

        gate, up, dy = inputs
        return _backward(swiglu(gate, up, backend), (gate, up), dy)

    return Case("swiglu", (("tokens", tokens), ("ffn", ffn)), make, step)


def cross_entropy_case(tokens: int, vocab: int) -> Case:
    def make(device, dtype):
        gen = torch.Generator().manual_seed(0)
        logits = _randn(gen, tokens, vocab, device=device, dtype=dtype, scale=2.0, grad=True)
        labels = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        return logits, labels, torch.full((tokens,), 1.0 / tokens, device=device)

    def step(backend, inputs):
        from megaft.kernels.cross_entropy import cross_entropy

        logits, labels, dy = inputs
        return _backward(cross_entropy(logits, labels, vocab_size=logits.shape[-1], backend=backend), (logits,), dy)

    return Case("cross_entropy", (("tokens", tokens), ("vocab", vocab)), make, step)


def linear_case(tokens: int, k: int, n: int, fuse_residual: bool = True, master_weights: bool = False) -> Case:
    """The MLP's down projection (RowParallelLinear) as training runs it: the weight is
    a parameter whose ``.grad`` is a view into a flat buffer (FlatParams' main grad), the
    GEMM runs under autocast at the case's dtype, and backward goes through autograd's
    AccumulateGrad, so the fused backends' weight gradient is accumulated into that
    buffer (megaft.kernels.linear.fused) while torch's is cast and added by autograd: the
    wgrad fusion is part of what is checked and timed. Weight, buffer and residual stream
    are fp32, or with ``master_weights`` (optim.master_weights) of the case's dtype (bf16
    params and grads; the hidden stream is bf16 too). The residual goes into the GEMM
    epilogue (Triton, cuBLASLt) only where RowParallelLinear puts it there
    (``fuse_residual``: tp=1); elsewhere it is a separate add. The returned weight
    gradient is the buffer's contents, accumulated over the calls on one set of inputs
    (one call per set in the agreement check)."""
    def make(device, dtype):
        gen = torch.Generator().manual_seed(0)
        param = dtype if master_weights else torch.float32  # params, grads and the residual stream
        weight = _randn(gen, n, k, device=device, dtype=param, scale=k ** -0.5, grad=True)
        main_grad = torch.zeros(n * k, device=device, dtype=param)  # the flat buffer; weight.grad is a view
        weight.grad = main_grad.view(n, k)
        return (_randn(gen, tokens, k, device=device, dtype=dtype, grad=True), weight, main_grad,
                _randn(gen, tokens, n, device=device, dtype=param),
                _randn(gen, tokens, n, device=device, dtype=param))

    def step(backend, inputs):
        from megaft.kernels.linear import EPILOGUE_BACKENDS, layer_linear

        x, weight, main_grad, residual, dy = inputs
        x.grad = None  # x's gradient is the call's own; the weight's accumulates, as in training
        with torch.autocast(x.device.type, dtype=x.dtype, enabled=x.dtype != torch.float32):
            if fuse_residual and backend in EPILOGUE_BACKENDS:
                out = layer_linear(x, weight, None, residual, backend=backend)
            else:
                out = residual + layer_linear(x, weight, backend=backend)
        torch.autograd.backward(out, dy, inputs=(x, weight))
        return [out.detach(), x.grad, main_grad.view(n, k)]

    shape = (("tokens", tokens), ("k", k), ("n", n), ("fused_residual", int(fuse_residual)),
             ("master_weights", int(master_weights)))
    return Case("linear", shape, make, step)


def grouped_gemm_case(tokens: int, top_k: int, k: int, m: int, experts: int) -> Case:
    """An MoE layer's gate (or up) projection: ``tokens`` x ``top_k`` rows sorted by expert
    through ``experts`` weights [m, k] (megaft.models.moe). The routing is drawn once from
    the seed: uneven, as a router's is, with each token's k experts distinct."""
    rows = tokens * top_k

    def make(device, dtype):
        gen = torch.Generator().manual_seed(0)
        scores = torch.randn(tokens, experts, generator=gen) + 0.5 * torch.randn(experts, generator=gen)
        counts = torch.bincount(scores.topk(min(top_k, experts), dim=-1).indices.reshape(-1), minlength=experts)
        return (_randn(gen, rows, k, device=device, dtype=dtype, grad=True),
                _randn(gen, experts, m, k, device=device, dtype=dtype, scale=k ** -0.5, grad=True),
                counts, _randn(gen, rows, m, device=device, dtype=dtype))

    def step(backend, inputs):
        from megaft.kernels.grouped_gemm import grouped_mm

        x, w, counts, dy = inputs
        return _backward(grouped_mm(x, w, counts, backend), (x, w), dy)

    shape = (("rows", rows), ("k", k), ("m", m), ("experts", experts))
    return Case("grouped_gemm", shape, make, step)


def model_cases(model, *, tp: int, batch: int, seq: int, master_weights: bool = False) -> dict[str, Case]:
    """The case of every op for a ModelConfig under tensor parallelism ``tp`` with
    micro-batches of ``batch`` sequences of ``seq`` tokens (on this rank);
    ``master_weights``: optim.master_weights (bf16 params and main grads: the linears).
    grouped_gemm has a case only for a mixture of experts (``model.n_experts``)."""
    seq = max(1, min(seq, MAX_TOKENS))
    batch = max(1, min(batch, MAX_TOKENS // seq))
    tokens = batch * seq
    ffn = max(1, model.ffn_dim // tp)
    out = {
        "rmsnorm": rmsnorm_case(tokens, model.dim, model.norm_eps),
        "rope": rope_case(batch, seq, max(1, model.n_heads // tp), max(1, model.kv_heads // tp), model.hd),
        "swiglu": swiglu_case(tokens, ffn),
        "cross_entropy": cross_entropy_case(min(tokens, MAX_CE_TOKENS), max(1, -(-model.vocab_size // tp))),
        "linear": linear_case(tokens, ffn, model.dim, fuse_residual=tp == 1, master_weights=master_weights),
    }
    if model.n_experts:
        top_k = min(model.top_k, model.n_experts)
        out["grouped_gemm"] = grouped_gemm_case(tokens, top_k, model.dim, max(1, model.expert_ffn // tp),
                                                model.n_experts)
    return out
