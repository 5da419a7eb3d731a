"""The last stage's head, as megaft.perf.time prices it: a causal LM's vocab-parallel output head and
cross-entropy, or a reward model's scalar `score` (train.objective=reward, issue 42).

An LM head (megaft.layers: a column-parallel [vocab/tp, dim] linear) multiplies every token of the
micro-batch (gathered from the sequence-parallel shards first) into this rank's vocabulary slice;
the loss then moves ~50 bytes a logit (megaft.perf.kernels_cost.loss_passes) and all-reduces three
fp32 values a token over tp (the max, the sum of exponentials, the target's logit); in backward the
input gradient reduces over tp (a reduce-scatter under sequence parallelism).

A reward model's head (megaft.models.decoder.make_score: HF *ForSequenceClassification's `score`,
[1, dim], whole on every tp rank) scores the tokens this rank holds (its sequence shard under
sequence parallelism, all of them otherwise): one GEMM of n = 1 a pass, bound by reading its input;
the scores, fp32 and one a token, are all-gathered over tp under sequence parallelism and nothing
reduces in backward (gather_from_tp's backward keeps each rank's own slice). The reward loss reads
one score a row and is too small to price.
"""
from __future__ import annotations

import dataclasses

from megaft.perf.counts import head_forward_flops
from megaft.perf.gemm import Linear, linear_s
from megaft.perf.kernels_cost import loss_passes, pass_s
from megaft.perf.memory import objective_terms
from megaft.perf.rates import all_reduce_s, gather_s

FP32 = 4


def with_score_head(cfg):
    """`cfg` with model.score_head set where train.objective builds a scalar head (validation's resolve
    sets it on megaft-train's config; the planner's configs may not have it)."""
    if cfg.model.score_head or not objective_terms(cfg).score_head:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, score_head=True))


def head_s(m, tokens: int, tp: int, sp: bool, rate: float, curve) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of the head on one tp rank for its `tokens`:
    the LM head's vocab/tp columns, or the scalar score over the tokens the rank holds; on the GEMM
    curve, or at `rate` without one."""
    if m.score_head:
        rows = tokens // tp if sp else tokens
        return linear_s(Linear(rows, m.dim, 1), curve) if curve else (rows * 2.0 * m.dim / rate,) * 3
    if curve is None:
        return (tokens * head_forward_flops(m) / tp / rate,) * 3
    return linear_s(Linear(tokens, m.dim, -(-m.vocab_size // tp)), curve)


def loss_s(m, tokens: int, tp: int, act: int, kc) -> tuple[float, float]:
    """(forward, backward) seconds of the loss's elementwise kernels: the cross-entropy over this rank's
    logits; none for a reward model (one score a row)."""
    if m.score_head or kc is None:
        return 0.0, 0.0
    f, b = loss_passes(m, tokens, tp, act, kc.compiled)
    return pass_s(f, kc), pass_s(b, kc)


def head_tp_s(m, tokens: int, tp: int, sp: bool, tp_one: float, link) -> tuple[float, float]:
    """(forward, backward) seconds of the head's tp collectives (`tp_one`: one block collective of the
    activations; `link`: the tp group's)."""
    if tp <= 1:
        return 0.0, 0.0
    if m.score_head:  # the fp32 scores of the sequence shards gathered; nothing in backward
        return (gather_s(tokens * FP32, tp, link) if sp else 0.0), 0.0
    return tp_one * sp + 3 * all_reduce_s(tokens * FP32, tp, link), tp_one


def head_params(m, tp: int) -> float:
    """Parameters of the head on one tp rank (what ZeRO-3 gathers and ZeRO-2 reduces for it)."""
    return m.dim if m.score_head else m.vocab_size * m.dim / tp
