"""Gradient compression for the data-parallel reduction (`parallel.grad_compression`).

bf16: each bucket is cast to bf16 for its collective and back to fp32 after it, so
  half the bytes go on the wire and the collective still sums. The sum itself runs in
  bf16 (8-bit mantissa): every partial sum is rounded to ~3 significant digits, so the
  result differs from the fp32 sum by up to ~2^-8 relative per add; loss curves
  follow the uncompressed run closely but not to fp32 rounding.

powersgd: Vogels et al. 2019 (Algorithm 1), rank r, with error feedback. Each 2-D
  weight gradient M (n x m, error added) is approximated as P Q^T:
      P = M Q;  all-reduce P;  P = orthonormalize(P)
      Q = M^T P;  all-reduce Q;  M_hat = P Q^T   (the dp SUM of the ranks' M)
  Q is warm-started from the previous step; its first value is a normal draw seeded by
  the matrix's shape, not its place in the layout, so the two copies of a tied embedding
  (first and last pipeline stage, fed the same gradient) stay identical. Each rank
  keeps E = M - M_hat / dp, so the sum over ranks of E is exactly what the sum M_hat left out, and it is sent in
  later steps. Vectors (norms, biases), bucket padding, and matrices that would not
  shrink ((n + m) r >= n m) go uncompressed in fp32. Wire cost per compressed matrix:
  (n + m) r instead of n m elements. torch's ddp_comm_hooks/powerSGD_hook.py was the
  reading reference; it averages, this module sums (the loss is pre-divided by the
  global target count, see megaft.parallel.data.buckets).

Everything here is fp32: P, Q, E and the bucket M_hat is written into. With bf16
gradients (`optim.master_weights`) the reducer hands in an fp32 copy of the bucket (the
upcast is exact) and rounds M_hat to bf16 once where it lands (megaft.parallel.data.buckets),
as it rounds the uncompressed fp32 dp sum. E is taken before that rounding: the rounding
is not fed back, it is the same one an uncompressed master-weights run makes.

A `PowerSGD` works in three phases per bucket, so the reducer can run the two
all-reduces asynchronously between them: `begin` (add the error, P = M Q, returns
the tensor to all-reduce: every P then the uncompressed elements), `middle` (takes
the reduced tensor, orthonormalizes P, returns the Q's to all-reduce) and `end`
(writes M_hat and the reduced uncompressed elements into the bucket, updates E).

Checkpoints: `state_dict()` holds each matrix's Q and this rank's E (with the
geometry they belong to); `load_state_dict` restores them bitwise, or raises
ValueError when the geometry differs (another layout, bucket size or rank), in which
case the caller restarts the state with `reset()` (megaft.parallel.data.buckets).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

COMPRESSIONS = ("none", "bf16", "powersgd")


def orthonormalize_(p: torch.Tensor) -> torch.Tensor:
    """Replace the columns of `p` by an orthonormal basis of their span (reduced QR; the
    paper's Gram-Schmidt, done by LAPACK in one call). Every rank gets the same summed P,
    so every rank computes the same basis."""
    p.copy_(torch.linalg.qr(p).Q)
    return p


def initial_q(n: int, m: int, rank: int, seed: int = 0) -> torch.Tensor:
    """The m x r starting Q of an n x m matrix: the same on every rank and every stage."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + n * 65_537 + m)
    return torch.randn(m, rank, generator=gen)


def compressible(shape: torch.Size, rank: int) -> bool:
    """A 2-D+ gradient whose rank-`rank` factors are smaller than it: (n + m) r < n m."""
    if len(shape) < 2:
        return False
    n, m = shape[0], shape.numel() // shape[0]
    return (n + m) * rank < n * m


@dataclass
class _Matrix:
    lo: int  # offset of the matrix in its bucket's gradient
    n: int
    m: int
    q: torch.Tensor  # m x r, warm start across steps
    error: torch.Tensor  # n x m error-feedback buffer of this rank
    p: torch.Tensor | None = None  # n x r of the current step


@dataclass
class _Plan:
    """One bucket: its compressed matrices and the [lo, hi) ranges sent as they are."""
    matrices: list[_Matrix]
    plain: list[tuple[int, int]]
    sizes: list[int] = field(default_factory=list)  # numel of each plain range


class PowerSGD:
    """Rank-`rank` PowerSGD state of one dp rank: warm-start Q and error per matrix.

    `layout[i]` lists bucket i's parameters as (offset in the bucket, shape); the
    gaps (padding) are sent uncompressed. Q starts from the same seeded normal on
    every rank, so the ranks' P's are summed in one basis."""

    def __init__(self, layout: list[list[tuple[int, torch.Size]]], numels: list[int], *, rank: int,
                 dp: int, device: torch.device, seed: int = 0):
        self.rank, self.dp, self.seed = rank, dp, seed
        self.plans: list[_Plan] = []
        for params, numel in zip(layout, numels):
            matrices, plain, at = [], [], 0
            for off, shape in sorted(params, key=lambda x: x[0]):
                if off > at:
                    plain.append((at, off))
                if compressible(shape, rank):
                    n = shape[0]
                    m = shape.numel() // n
                    q = initial_q(n, m, rank, seed).to(device)
                    matrices.append(_Matrix(off, n, m, q, torch.zeros(n, m, device=device)))
                else:
                    plain.append((off, off + shape.numel()))
                at = off + shape.numel()
            if numel > at:
                plain.append((at, numel))
            self.plans.append(_Plan(matrices, plain, [hi - lo for lo, hi in plain]))

    def _shape(self) -> dict:
        """What a saved state must match: r, dp, and (offset, n, m) of every matrix per bucket."""
        return {"rank": self.rank, "dp": self.dp,
                "geometry": [[(a.lo, a.n, a.m) for a in plan.matrices] for plan in self.plans]}

    def state_dict(self) -> dict:
        """Q and this rank's error of every matrix (CPU tensors), with their geometry."""
        mats = [a for plan in self.plans for a in plan.matrices]
        return {**self._shape(), "q": [a.q.cpu() for a in mats], "error": [a.error.cpu() for a in mats]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()` of the same geometry; ValueError (nothing changed) otherwise."""
        mine = self._shape()
        for key in ("rank", "dp", "geometry"):
            got = [list(map(tuple, g)) for g in state[key]] if key == "geometry" else state[key]
            want = mine[key]
            if got != want:
                raise ValueError(f"the saved PowerSGD {key} differs from this run's"
                                 + ("" if key == "geometry" else f" ({got} vs {want})"))
        mats = [a for plan in self.plans for a in plan.matrices]
        for a, q, e in zip(mats, state["q"], state["error"]):
            a.q.copy_(q)
            a.error.copy_(e)

    @torch.no_grad()
    def reset(self) -> None:
        """Fresh state: the initial Q's and zero errors (what a new run starts from)."""
        for plan in self.plans:
            for a in plan.matrices:
                a.q = initial_q(a.n, a.m, self.rank, self.seed).to(a.error.device)
                a.error.zero_()
                a.p = None

    def wire_bytes(self, i: int) -> tuple[int, int]:
        """fp32 bytes of bucket i's two all-reduces (P's + plain elements, then Q's)."""
        plan = self.plans[i]
        return 4 * (sum(a.n * self.rank for a in plan.matrices) + sum(plan.sizes)), \
            4 * sum(a.m * self.rank for a in plan.matrices)

    @torch.no_grad()
    def begin(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Add the error to bucket i's matrices (in `grad`, its flat fp32 gradient) and
        return [P of every matrix, plain elements] flat, to be summed over dp."""
        if grad.dtype != torch.float32:  # bf16 buckets are upcast by the caller (megaft.parallel.data.buckets)
            raise TypeError(f"PowerSGD works on fp32 buckets, got {grad.dtype}; pass grad.float()")
        plan = self.plans[i]
        parts = []
        for a in plan.matrices:
            mat = grad[a.lo:a.lo + a.n * a.m].view(a.n, a.m)
            mat.add_(a.error)
            a.p = mat @ a.q
            parts.append(a.p.reshape(-1))
        parts += [grad[lo:hi] for lo, hi in plan.plain]
        return torch.cat(parts) if parts else grad.new_zeros(0)

    @torch.no_grad()
    def middle(self, i: int, grad: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
        """Take the summed P's, orthonormalize them, return Q = M^T P of every matrix flat."""
        plan = self.plans[i]
        at, parts = 0, []
        for a in plan.matrices:
            a.p = orthonormalize_(reduced[at:at + a.n * self.rank].view(a.n, self.rank).clone())
            at += a.n * self.rank
            mat = grad[a.lo:a.lo + a.n * a.m].view(a.n, a.m)
            a.q = mat.T @ a.p
            parts.append(a.q.reshape(-1))
        return torch.cat(parts) if parts else grad.new_zeros(0)

    @torch.no_grad()
    def end(self, i: int, grad: torch.Tensor, reduced_p: torch.Tensor, reduced_q: torch.Tensor) -> None:
        """Write M_hat = P Q^T (the dp sum) and the summed plain elements into `grad`, keep
        E = M - M_hat / dp; the summed Q is the next step's warm start."""
        plan = self.plans[i]
        at = sum(a.n for a in plan.matrices) * self.rank
        for (lo, hi), n in zip(plan.plain, plan.sizes):
            grad[lo:hi].copy_(reduced_p[at:at + n])
            at += n
        at = 0
        for a in plan.matrices:
            a.q = reduced_q[at:at + a.m * self.rank].view(a.m, self.rank).clone()
            at += a.m * self.rank
            mat = grad[a.lo:a.lo + a.n * a.m].view(a.n, a.m)
            approx = a.p @ a.q.T
            torch.sub(mat, approx, alpha=1.0 / self.dp, out=a.error)
            mat.copy_(approx)
            a.p = None
