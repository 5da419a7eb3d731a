"""The attention core by sequence length: a flash kernel's measured speed, causal (issue 42).

megaft counts the core over whole rows (megaft.perf.counts.attention_core_flops: 4 s d h a sequence,
PaLM's count); a causal flash kernel computes about half of it, and its speed grows with the
sequence (short rows leave the tiles and the softmax pipeline half used). A cluster preset can hold
the kernel's measured rates (`cluster.attention_*`, TFLOP/s as the kernel's benchmark counts them)
at a few sequence lengths, all at head dim 128 and bf16:

* forward without a mask (FLOPs 4 s^2 d h) and with the causal mask (FLOPs counted at half);
* backward without a mask (FLOPs 2.5 x the forward's: five matmuls with the recomputation).

A layout's core then takes, per call of sequence s (data.seq_len / cp: a ring step's block):
forward (megaft's whole-row FLOPs / 2) / causal forward rate(s); backward 2.5 x that / the backward's
rate(s) times the causal/unmasked ratio of the forward (no causal backward is published: the mask
is assumed to cost the backward what it costs the forward). Between the listed lengths the rates
are linear in log2(s), outside them the nearest. Other head dims use the head dim 128 curve. The
rates scale with cluster.compute_scale like every compute rate (megaft.perf.rates), and with the
preset's peak over its gpu_type's datasheet peak (megaft.perf.hardware.peak_ratio): the curve is measured
on the datasheet part, and a flash kernel at these lengths is bound by the tensor cores' clock as a GEMM
is (a power-capped part runs both slower by the same ratio); the HBM-bound kernels do not move with it.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional

from megaft.perf.hardware import peak_ratio

BACKWARD_FLOPS = 2.5  # the flash papers' count of the backward: 5 matmuls to the forward's 2


@dataclass(frozen=True)
class AttentionCurve:
    """A kernel's rates (FLOP/s) at increasing sequence lengths."""

    seq: tuple
    fwd: tuple
    fwd_causal: tuple
    bwd: tuple

    @classmethod
    def of(cls, cluster, precision: str) -> Optional["AttentionCurve"]:
        """The preset's curve, or None (the core at matmul_fraction) without one or at fp32 (the rates are bf16's)."""
        if not cluster.attention_seq or precision not in ("bf16", "fp16"):
            return None
        s = cluster.compute_scale / peak_ratio(cluster, precision)  # calibrated, and the part's clock
        return cls(tuple(cluster.attention_seq), *(tuple(x * 1e12 / s for x in rates) for rates in (
            cluster.attention_fwd_tflops, cluster.attention_fwd_causal_tflops, cluster.attention_bwd_tflops)))

    def rate(self, rates: tuple, seq: int) -> float:
        """`rates` at sequence length `seq`: linear in log2(seq) between the listed lengths, the nearest outside."""
        i = bisect.bisect_left(self.seq, seq)
        if i == 0:
            return rates[0]
        if i == len(self.seq):
            return rates[-1]
        lo, hi = math.log2(self.seq[i - 1]), math.log2(self.seq[i])
        t = (math.log2(seq) - lo) / (hi - lo)
        return rates[i - 1] + t * (rates[i] - rates[i - 1])

    def core_s(self, flops: float, seq: int) -> tuple[float, float]:
        """(forward, backward) seconds of a causal core whose whole-row forward FLOPs are `flops` (megaft's
        count), in calls of sequence length `seq`."""
        causal = self.rate(self.fwd_causal, seq)
        forward = flops / 2 / causal
        backward = BACKWARD_FLOPS * flops / 2 / (self.rate(self.bwd, seq) * causal / self.rate(self.fwd, seq))
        return forward, backward
