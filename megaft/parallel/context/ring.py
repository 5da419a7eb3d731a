"""Ring attention over the cp group (megaft.parallel.context.layout says who holds which tokens).

K and V (kv heads only under GQA) travel around the cp group, one block per step, with
asynchronous p2p that overlaps the attention of the block in hand. Each block's partial
output merges with the running one through their log-sum-exps (plain blocks through a
flash kernel, see `block_plan`). Backward recomputes each block's probabilities from the
saved log-sum-exp (nothing of size seq² is kept) while K/V travel the ring again, and the
dK/dV accumulators travel with them, one step behind, until they are home.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from megaft.parallel.comm import Group, group_rank, group_size
from megaft.parallel.context.layout import ContextShard

# -- one block -------------------------------------------------------------------------

def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads [b, kv, s, d] -> [b, kv*groups, s, d] (query head i reads kv head i // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, mask, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with fully masked rows (-inf) at 0, so exp(scores - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_forward(q, k, v, mask, scale):
    """(out, lse) of q [b, h, sq, d] against one key block (fp32)."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v), lse


def merge(out, lse, block_out, block_lse):
    """Softmax-weighted union of two partial attentions over disjoint key sets."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    return (out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1),
            new)


def block_backward(q, k, v, dout, delta, lse, mask, scale):
    """(dq, dk, dv) of one key block given the final lse and delta = rowsum(dout * out)."""
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


# -- a block through a fused kernel ----------------------------------------------------
#
# Without packed documents or a sliding window, every block of the zig-zag layout is
# plain: this rank's own block is causal on local order (chunk i before chunk 2cp-1-i),
# a block from a lower cp rank is seen whole by every query but only through its first
# chunk, and one from a higher rank is seen whole by the second chunk of queries only.
# Such blocks go through a flash kernel that returns the log-sum-exp (torch's CPU flash
# kernel; on CUDA the flash kernel for bf16/fp16, checked once against the explicit
# form before it is trusted), so no seq × seq scores are ever materialized. Masked
# blocks (documents, windows) use the explicit fp32 form above.

ALL = slice(None)


def block_plan(shard: ContextShard, src: int, window: Optional[int], device):
    """How this rank's queries meet cp rank `src`'s keys: None (no pair attends), or
    (query rows, key rows, causal, mask) with `mask` set only for masked blocks."""
    if shard.doc_ids is None and window is None:
        c, r = shard.seq // (2 * shard.size), shard.rank
        if src == r:
            return ALL, ALL, True, None
        return (ALL, slice(0, c), False, None) if src < r else (slice(c, None), ALL, False, None)
    mask = shard.mask(src, window, device)
    return None if mask is False else (ALL, ALL, False, mask)


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _flash_fwd(q, k, v, causal, scale):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_bwd(dout, q, k, v, out, lse, causal, scale):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    empty = torch.empty(0, dtype=torch.int32, device=q.device)  # dense rows: no cumulative lengths, no dropout
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, empty, empty, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)


def use_flash(q: torch.Tensor) -> bool:
    """Whether plain blocks of q's device and dtype go through the flash kernel."""
    if q.device.type == "cpu":
        return True
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and _cuda_flash_ok(q.dtype)


@functools.cache
def _cuda_flash_ok(dtype: torch.dtype) -> bool:
    """The CUDA flash path equals the explicit form on a small block (forward and backward);
    otherwise a warning, and the explicit form is used."""
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(1, 2, 64, 64, device="cuda", generator=g, dtype=dtype) for _ in range(4))
        scale = 64 ** -0.5
        out, lse = _flash_fwd(q, k, v, True, scale)
        ref_out, ref_lse = block_forward(q.float(), k.float(), v.float(), _causal_mask(64, 64, q.device), scale)
        delta = (dout.float() * out.float()).sum(-1)
        grads = _flash_bwd(dout, q, k, v, out, lse, True, scale)
        ref = block_backward(q.float(), k.float(), v.float(), dout.float(), delta, lse.float(),
                             _causal_mask(64, 64, q.device), scale)
        ok = torch.allclose(out.float(), ref_out, atol=3e-2) and torch.allclose(lse.float(), ref_lse, atol=3e-2) \
            and all(torch.allclose(a.float(), b, atol=5e-2) for a, b in zip(grads, ref))
        why = "differs from the explicit form"
    except Exception as exc:  # an op signature this torch does not have
        ok, why = False, f"failed: {exc}"
    if not ok:
        warnings.warn(f"ring attention: the CUDA flash kernel {why}; blocks use the explicit fp32 form "
                      "(correct, more memory)", RuntimeWarning, stacklevel=2)
    return ok


def attend_block(q, k, v, causal: bool, mask, scale: float):
    """(out fp32, lse) of one block."""
    if mask is None and use_flash(q):
        out, lse = _flash_fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale)
        return out.float(), lse.float()
    if causal:
        mask = _causal_mask(q.shape[2], k.shape[2], q.device)
    return block_forward(q.float(), k.float(), v.float(), mask, scale)


def attend_block_backward(dout, q, k, v, out, lse, delta, causal: bool, mask, scale: float):
    """(dq, dk, dv) of one block, from the final output and log-sum-exp of the queries."""
    if mask is None and use_flash(q):
        return _flash_bwd(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                          lse.contiguous(), causal, scale)
    if causal:
        mask = _causal_mask(q.shape[2], k.shape[2], q.device)
    return block_backward(q.float(), k.float(), v.float(), dout.float(), delta, lse, mask, scale)


# -- the ring --------------------------------------------------------------------------

KV_TAG, GRAD_TAG = 1, 2
_SENT = [0]  # bytes sent around rings so far (benchmarks/memory.py checks megaft.perf.counts.ring_bytes)


def bytes_sent() -> int:
    """Bytes this process has sent around cp rings so far."""
    return _SENT[0]


class _Ring:
    """Asynchronous exchange with the cp neighbours: send to rank+1, receive from rank-1."""

    def __init__(self, group: Group):
        cp, r = group_size(group), group_rank(group)
        self.group = group
        self.next = dist.get_global_rank(group, (r + 1) % cp)
        self.prev = dist.get_global_rank(group, (r - 1) % cp)

    def start(self, x: torch.Tensor, tag: int):
        """Send `x`, receive a tensor like it: (buffer, requests); `finish` waits. K/V and
        their gradients may be in flight together: each kind has its own tag."""
        buf = torch.empty_like(x)
        _SENT[0] += x.numel() * x.element_size()
        ops = [dist.P2POp(dist.isend, x, self.next, self.group, tag),
               dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)]
        return buf, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending) -> torch.Tensor:
        buf, reqs = pending
        for req in reqs:
            req.wait()
        return buf


class RingAttention(torch.autograd.Function):
    """softmax(QKᵀ·scale + mask)V over the whole row, for q [b, h, s, d] and k/v
    [b, kv, s, d] holding this rank's tokens (`shard`)."""

    @staticmethod
    def forward(ctx, q, k, v, shard: ContextShard, window: Optional[int], scale: float):
        with torch.autocast(q.device.type, enabled=False):  # fp32 softmax and merge, whatever the precision
            return RingAttention._forward(ctx, q, k, v, shard, window, scale)

    @staticmethod
    def _forward(ctx, q, k, v, shard, window, scale):
        ring, cp, r = _Ring(shard.group), shard.size, shard.rank
        groups = q.shape[1] // k.shape[1]
        kv = torch.stack([k, v]).contiguous()
        b, h, s, d = q.shape
        out = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(cp):
            pending = ring.start(kv, KV_TAG) if step + 1 < cp else None  # the next block travels meanwhile
            plan = block_plan(shard, (r - step) % cp, window, q.device)
            if plan is not None:
                qs, ks, causal, mask = plan
                kb, vb = _expand(kv[0][:, :, ks], groups), _expand(kv[1][:, :, ks], groups)
                o, l_ = attend_block(q[:, :, qs], kb, vb, causal, mask, scale)
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, l_)
            if pending is not None:
                kv = ring.finish(pending)
        # every query sees itself (causal), so the own block always contributes. Saved: what
        # SDPA saves (q, k, v, the output in their dtype) and the fp32 log-sum-exp; the output
        # laid out [b, s, h, d] in memory, as SDPA returns it, so o_proj's input is a view of it
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.window, ctx.scale = shard, window, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        shard, window, scale = ctx.shard, ctx.window, ctx.scale
        ring, cp, r = _Ring(shard.group), shard.size, shard.rank
        groups = q.shape[1] // k.shape[1]
        dout = dout.to(q.dtype)
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        # dkv: the accumulator of the block in hand, [2, b, kv, s, d]; it follows its K/V
        # around the ring one step behind and is home after the cp-th exchange.
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        grad_pending = None
        for step in range(cp):
            kv_pending = ring.start(kv, KV_TAG) if step + 1 < cp else None
            plan = block_plan(shard, (r - step) % cp, window, q.device)
            block = None
            if plan is not None:
                qs, ks, causal, mask = plan
                kb, vb = _expand(kv[0][:, :, ks], groups), _expand(kv[1][:, :, ks], groups)
                dq_b, dk_b, dv_b = attend_block_backward(dout[:, :, qs], q[:, :, qs], kb, vb, out[:, :, qs],
                                                         lse[:, :, qs], delta[:, :, qs], causal, mask, scale)
                dq[:, :, qs] += dq_b.float()
                block = ks, _reduce_heads(dk_b.float(), groups), _reduce_heads(dv_b.float(), groups)
            if grad_pending is not None:
                dkv = ring.finish(grad_pending)  # this block's accumulator, from rank - 1
            if block is not None:
                ks, dk_b, dv_b = block
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            grad_pending = ring.start(dkv, GRAD_TAG)
            if kv_pending is not None:
                kv = ring.finish(kv_pending)
        dkv = ring.finish(grad_pending)  # home: own K/V's gradient from every rank
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _reduce_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of `_expand`: sum the query heads that read one kv head."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard,
                   window: Optional[int] = None) -> torch.Tensor:
    """Causal (windowed, document-separated) attention of this rank's tokens over the whole
    row, as F.scaled_dot_product_attention with enable_gqa would compute it unsplit."""
    if shard.size < 2:
        raise ValueError("ring_attention needs a cp group of 2 or more ranks")
    return RingAttention.apply(q, k, v, shard, window, q.shape[-1] ** -0.5)
