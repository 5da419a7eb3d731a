"""Cross-entropy without an fp32 copy of all logits, and fused with the head projection.

Both split the loss into per-token statistics of this rank's vocabulary slice,
combined over tp, and a gradient pass (Megatron's vocab-parallel scheme, with an
online logsumexp so that a slice is read once):

    stats (per backend)  m = max_j x_j,  s = sum_j exp(x_j - m),  t = x_label (0 when
                         the label is not in this slice); padded columns are skipped
    combine (here)       M = max_tp m,  S = sum_tp s * exp(m - M),  T = sum_tp t
                         lse = M + log S,  loss = lse - T  (0 for ignored tokens)
    grad (per backend)   dx_j = g * (exp(x_j - lse) - [j == label])

The backends are ``torch`` (row chunks, fp32 per chunk only), ``triton``
(megaft.kernels.cross_entropy.triton: one program per row, vocabulary blocks) and
``cuda`` (megaft.kernels.cross_entropy.cuda: csrc/cuda/cross_entropy.cu, block per row).

:class:`LinearCrossEntropy` never materializes the logits of the whole batch: the
forward computes ``hidden_c @ weight.T`` for one chunk of tokens at a time and keeps
only the per-token lse; the backward recomputes each chunk's logits and turns them
into ``grad_hidden_c = dx_c @ weight`` and ``grad_weight += dx_c.T @ hidden_c`` (fp32).
Recomputing costs one extra matmul per chunk but keeps the upstream gradient per token
arbitrary and the saved state to N floats (Liger instead computes the gradient in the
forward, which needs a scalar loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaft.kernels.cross_entropy.reference import IGNORE_INDEX
from megaft.parallel.comm import Group, group_size

TORCH_ROWS = 1024  # rows per fp32 chunk of the torch backend's statistics and gradient


def _torch_stats(x: torch.Tensor, labels: torch.Tensor, vocab_start: int, n_real: int):
    """(m, s, t) per row of x [N, V_local]; columns >= n_real are padding."""
    n, local = x.shape
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    s, t = torch.zeros_like(m), torch.zeros_like(m)
    if n_real == 0:
        return m, s, t
    local_label = labels - vocab_start
    mine = (labels != IGNORE_INDEX) & (local_label >= 0) & (local_label < n_real)
    for r in range(0, n, TORCH_ROWS):
        xc = x[r:r + TORCH_ROWS, :n_real].float()
        mc = xc.max(dim=-1).values
        m[r:r + TORCH_ROWS] = mc
        s[r:r + TORCH_ROWS] = (xc - mc.unsqueeze(-1)).exp().sum(dim=-1)
        idx = local_label[r:r + TORCH_ROWS].clamp(0, n_real - 1).unsqueeze(-1)
        t[r:r + TORCH_ROWS] = torch.where(mine[r:r + TORCH_ROWS], xc.gather(1, idx).squeeze(-1), 0.0)
    return m, s, t


def _torch_grad(x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                vocab_start: int, n_real: int) -> torch.Tensor:
    """dx [N, V_local] in x's dtype: g * (softmax - onehot); padding columns get 0."""
    dx = torch.zeros_like(x)
    local_label = labels - vocab_start
    mine = (labels != IGNORE_INDEX) & (local_label >= 0) & (local_label < n_real)
    for r in range(0, x.shape[0], TORCH_ROWS):
        rows = slice(r, r + TORCH_ROWS)
        p = (x[rows, :n_real].float() - lse[rows].unsqueeze(-1)).exp()
        idx = local_label[rows].clamp(0, max(n_real - 1, 0)).unsqueeze(-1)
        p.scatter_add_(1, idx, -mine[rows].to(p.dtype).unsqueeze(-1))
        dx[rows, :n_real] = (p * g[rows].unsqueeze(-1)).to(x.dtype)
    return dx


def _impl(backend: str):
    """(stats, grad) functions of `backend` ("torch", "triton" or "cuda")."""
    if backend == "cuda":
        from megaft.kernels.cross_entropy import cuda

        return cuda.stats, cuda.grad
    if backend == "triton":
        from megaft.kernels import _triton

        mod = _triton.load("cross_entropy")
        return mod.stats, mod.grad
    return _torch_stats, _torch_grad


def combine(m, s, t, labels, group: Group):
    """(loss, lse) per token from this rank's (m, s, t): three all-reduces over tp."""
    if group_size(group) > 1:
        big = m.clone()
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)  # exact in any order
        # exp(-inf - M) = 0: a slice that is all padding contributes nothing
        s = s * (m - big).exp()
        both = torch.stack([s, t])
        dist.all_reduce(both, group=group)
        m, s, t = big, both[0], both[1]
    lse = m + s.log()
    loss = torch.where(labels != IGNORE_INDEX, lse - t, torch.zeros_like(lse))
    return loss, lse


def _real_columns(local: int, vocab_start: int, vocab_size: int) -> int:
    return max(0, min(local, vocab_size - vocab_start))


class CrossEntropy(torch.autograd.Function):
    """Per-token loss from logits [N, V_local]; saves the logits (no copy) and lse."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, vocab_size, backend):
        stats, _ = _impl(backend)
        x = logits.contiguous()
        n_real = _real_columns(x.shape[-1], vocab_start, vocab_size)
        loss, lse = combine(*stats(x, labels, vocab_start, n_real), labels, group)
        ctx.save_for_backward(x, labels, lse)
        ctx.args = (vocab_start, n_real, backend)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, labels, lse = ctx.saved_tensors
        vocab_start, n_real, backend = ctx.args
        g = (grad_loss.float() * (labels != IGNORE_INDEX)).contiguous()
        return _impl(backend)[1](x, labels, lse, g, vocab_start, n_real), None, None, None, None, None


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``hidden [N, D] @ weight[V_local, D].T``, chunk by chunk over tokens."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group, vocab_start, vocab_size, backend, chunk):
        stats, _ = _impl(backend)
        n = hidden.shape[0]
        n_real = _real_columns(weight.shape[0], vocab_start, vocab_size)
        parts = [stats(hidden[r:r + chunk] @ weight.t(), labels[r:r + chunk], vocab_start, n_real)
                 for r in range(0, n, chunk)]
        if parts:
            m, s, t = (torch.cat(p) for p in zip(*parts))
        else:
            m = s = t = hidden.new_zeros(0, dtype=torch.float32)
        loss, lse = combine(m, s, t, labels, group)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.args = (vocab_start, n_real, backend, chunk)
        # The backward recomputes the logits: under the forward's autocast, so that they
        # (and the saved lse) have the same rounding.
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        vocab_start, n_real, backend, chunk = ctx.args
        grad_fn = _impl(backend)[1]
        g = (grad_loss.float() * (labels != IGNORE_INDEX)).contiguous()
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        device, dtype, enabled = ctx.autocast
        for r in range(0, hidden.shape[0], chunk):
            h = hidden[r:r + chunk]
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                logits = (h @ weight.t()).contiguous()
                # the CUDA kernel writes the gradient over this temporary chunk of logits
                kw = {"inplace": True} if backend == "cuda" else {}
                dx = grad_fn(logits, labels[r:r + chunk], lse[r:r + chunk], g[r:r + chunk], vocab_start, n_real, **kw)
                d_hidden[r:r + chunk] = dx @ weight
            d_weight.addmm_(dx.t().float(), h.float())  # fp32 accumulation over chunks
        return d_hidden, d_weight.to(weight.dtype), None, None, None, None, None, None
