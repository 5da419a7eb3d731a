"""Sequence-parallel collective matmuls (`parallel.tp_overlap=ring`): the sequence all-gather
before the column-parallel linears and the reduce-scatter after the row-parallel ones, each
run as a ring of tp steps in which one chunk's GEMM overlaps the next chunk's transfer.

Wang et al. 2023 ("Overlap communication with dependent computation via decomposition")
and Megatron's `--tp-comm-overlap` do the same; torch's async-TP does it with symmetric
memory (CUDA and NCCL only). Here the transfers are `batch_isend_irecv` between ring
neighbours, so one code runs on gloo (CPU, where the tests prove the values) and on NCCL
(whose p2p kernels run on the communicator's own stream: the GEMM issued between posting
a transfer and waiting on it runs beside it, no extra stream is needed).

- `ring_column(x, weights, biases, group)`: x is this rank's sequence shard; returns the
  gathered input (the LoRA adapters and anything else reading it take it from here, the
  ring runs once per shared input: q/k/v, gate/up) and each weight's output, every chunk's
  rows written as its GEMM ends. Backward: the input gradient's reduce-scatter is a ring
  of partial sums, each step's local GEMM overlapping the previous step's transfer, and the
  weight gradients over the gathered input overlap the first transfer.
- `ring_row(x, weight, extra, group)`: the row-parallel partial product reduce-scattered by
  the same ring (`extra`, a LoRA adapter's partial output, joins the local part); backward
  all-gathers the output gradient by the ring, each chunk's input-gradient GEMM as it comes.

Values: each chunk's GEMM is the rows of the one GEMM (the same dot products), and the
weight gradients are the same GEMMs as F.linear's backward; only the sums over ranks run
in ring order instead of the collective's, so results equal the plain path to fp32
reassociation (bitwise at tp=2, where a sum of two terms has one order).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megaft.parallel.comm import Group, group_rank, group_size


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """F.linear's compute dtype: the autocast dtype when autocast is on, else x's (the rule of
    megaft.kernels.linear.main_grad, which sits above this folder)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _post(send: torch.Tensor, recv: torch.Tensor, group: Group) -> list:
    """Send `send` to the next rank of the ring, receive `recv` from the previous one."""
    n, r = group_size(group), group_rank(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                   dist.P2POp(dist.irecv, recv, prv, group)])


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _seq_first(t: torch.Tensor, n: int) -> torch.Tensor:
    """[b, s, f] -> [n, s/n, b, f]: chunk c of the sequence is one contiguous block (free at b=1)."""
    b, s, f = t.shape
    return t.transpose(0, 1).contiguous().view(n, s // n, b, f)


def _batch_first(t: torch.Tensor) -> torch.Tensor:
    """[n, s/n, b, f] -> [b, s, f] (contiguous)."""
    n, s, b, f = t.shape
    return t.view(n * s, b, f).transpose(0, 1).contiguous()


def ring_gather(chunk: torch.Tensor, group: Group, on_chunk) -> torch.Tensor:
    """All-gather of `chunk` ([s/n, b, f]) by the ring into [n, s/n, b, f]; `on_chunk(c, t)`
    runs on each chunk as it arrives, while the next one travels."""
    n, r = group_size(group), group_rank(group)
    full = chunk.new_empty((n,) + chunk.shape)
    full[r].copy_(chunk)
    for i in range(n):
        c = (r - i) % n  # the chunk this rank holds at step i
        works = _post(full[c], full[(c - 1) % n], group) if i < n - 1 else []
        on_chunk(c, full[c])
        _wait(works)
    return full


def ring_reduce_scatter(local, group: Group, during=None) -> torch.Tensor:
    """Sum over ranks of `local(c)` ([s/n, b, f], this rank's part of chunk c), keeping this
    rank's chunk: each step's local GEMM runs while the previous step's partial sum travels.
    `during()` runs once, beside the first transfer."""
    n, r = group_size(group), group_rank(group)
    works, acc, recv = [], None, None
    for i in range(n):
        part = local((r - i - 1) % n)  # at the last step, this rank's own chunk
        if i == 1 and during is not None:
            during()
        if i > 0:
            _wait(works)
            part = recv + part
        if i < n - 1:
            acc, recv = part, torch.empty_like(part)
            works = _post(acc, recv, group)
    if n == 1 and during is not None:
        during()
    return part


class _RingColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, count, *params):
        weights, biases = params[:count], params[count:]
        n, dt = group_size(group), compute_dtype(x)
        ctx.group, ctx.count, ctx.bias_dtypes = group, count, [None if b is None else b.dtype for b in biases]
        ctx.set_materialize_grads(False)
        ws = [w.to(dt) for w in weights]
        bs = [None if b is None else b.to(dt) for b in biases]
        b, s, _ = x.shape
        outs = [x.new_empty((n, s, b, w.shape[0]), dtype=dt) for w in ws]

        def gemms(c, chunk):
            rows = chunk.to(dt).view(s * b, -1)
            for out, w, bias in zip(outs, ws, bs):
                dst = out[c].view(s * b, -1)
                torch.mm(rows, w.t(), out=dst) if bias is None else torch.addmm(bias, rows, w.t(), out=dst)

        with torch.autocast(x.device.type, enabled=False):
            full = _batch_first(ring_gather(x.transpose(0, 1).contiguous(), group, gemms))
        ys = [_batch_first(out) for out in outs]
        ctx.save_for_backward(full, *weights)
        ctx.dt = dt
        return (full, *ys)

    @staticmethod
    def backward(ctx, g_full, *gys):
        full, *weights = ctx.saved_tensors
        group, n, dt = ctx.group, group_size(ctx.group), ctx.dt
        live = [(i, gy.to(dt)) for i, gy in enumerate(gys) if gy is not None]
        grads_w: list = [None] * ctx.count
        grads_b: list = [None] * ctx.count

        def wgrads():  # F.linear's backward GEMMs over the gathered input
            x2d = full.to(dt).reshape(-1, full.shape[-1])
            for i, gy in live:
                gy2d = gy.reshape(-1, gy.shape[-1])
                if ctx.needs_input_grad[3 + i]:
                    grads_w[i] = gy2d.t().mm(x2d).to(weights[i].dtype)
                if ctx.bias_dtypes[i] is not None and ctx.needs_input_grad[3 + ctx.count + i]:
                    grads_b[i] = gy2d.sum(0).to(ctx.bias_dtypes[i])

        with torch.autocast(full.device.type, enabled=False):
            gx = None
            if ctx.needs_input_grad[0]:
                seq = [(_seq_first(gy, n), weights[i].to(dt)) for i, gy in live]
                g_seq = None if g_full is None else _seq_first(g_full, n)

                def local(c):
                    part = None if g_seq is None else g_seq[c].to(dt)
                    for gy, w in seq:
                        term = torch.matmul(gy[c], w)
                        part = term if part is None else part + term
                    if part is None:  # no output was used: a zero gradient
                        part = full.new_zeros((full.shape[1] // n, full.shape[0], full.shape[2]), dtype=dt)
                    return part

                gx = ring_reduce_scatter(local, group, during=wgrads).transpose(0, 1).contiguous()
                gx = gx.to(full.dtype)
            else:
                wgrads()
        return (gx, None, None, *grads_w, *grads_b)


class _RingRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, extra, group):
        n, dt = group_size(group), compute_dtype(x)
        ctx.group, ctx.dt = group, dt
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(dt)
            xs = _seq_first(x.to(dt), n)
            ex = None if extra is None else _seq_first(extra.to(dt), n)

            def local(c):
                part = torch.matmul(xs[c], w.t())
                return part if ex is None else part + ex[c]

            y = ring_reduce_scatter(local, group).transpose(0, 1).contiguous()
        ctx.save_for_backward(x, weight)
        ctx.has_extra = extra is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        group, dt = ctx.group, ctx.dt
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(dt)
            n, (b, seq, width) = group_size(group), x.shape
            gx = x.new_empty((n, seq // n, b, width), dtype=dt) if ctx.needs_input_grad[0] else None

            def dgrad(c, chunk):  # this chunk's rows of F.linear's input gradient
                if gx is not None:
                    torch.mm(chunk.view(-1, chunk.shape[-1]), w, out=gx[c].view(-1, width))

            g_full = _batch_first(ring_gather(gy.to(dt).transpose(0, 1).contiguous(), group, dgrad))
            gw = None
            if ctx.needs_input_grad[1]:
                gw = g_full.reshape(-1, g_full.shape[-1]).t().mm(x.to(dt).reshape(-1, x.shape[-1])).to(weight.dtype)
            gx = None if gx is None else _batch_first(gx).to(x.dtype)
        return gx, gw, (g_full if ctx.has_extra else None), None


def ring_column(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                group: Group) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(gathered x, [x_full @ w.T + b for each weight]) with the gather overlapped (module doc).
    x: [batch, seq/tp, in], this rank's sequence shard."""
    out = _RingColumn.apply(x, group, len(weights), *weights, *biases)
    return out[0], list(out[1:])


def ring_row(x: torch.Tensor, weight: torch.Tensor, group: Group,
             extra: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reduce_scatter(x @ weight.T + extra) along the sequence, overlapped (module doc).
    x: [batch, seq, in/tp]; returns [batch, seq/tp, out]."""
    return _RingRow.apply(x, weight, extra, group)
