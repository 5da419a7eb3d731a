"""Multi-tensor AdamW in Triton: one launch per (param dtype, grad dtype) for a whole
list of tensors of different sizes.

The host cuts every tensor into chunks of ``CHUNK`` elements and writes two small
device tables: per tensor the addresses of its operands and its size (int64) plus its
float32 constants; per chunk (tensor index, chunk start). Program ``c`` handles chunk
``c``: it reads its tensor's row, turns the addresses into typed pointers and walks
the chunk ``BLOCK`` elements at a time. The address/size table depends only on the
tensors, so it is cached; the constants (lr, bias corrections) are uploaded each step.

Rounding follows csrc/cpu/adamw.cpp, so results equal megaft._C bit for bit: explicit
fma where torch's lerp/addcmul use one, IEEE division and sqrt (``div_rn``,
``sqrt_rn``; Triton's ``/`` and ``tl.sqrt`` are approximate on GPUs), and no fp
contraction (``enable_fp_fusion=False``). bf16 is converted with integer ops
(round-to-nearest-even), which the CPU interpreter also gets right. Full chunks run
unmasked and, when the host has seen that every address is 16-byte aligned, with
alignment hints, so that their loads and stores are 16-byte vector ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megaft.kernels.adamw.tensor_lists import TensorLists, lerp_small, scalars

CHUNK = 16384  # elements per program: ~450 KB of traffic, enough programs from 10M params
BLOCK = 1024  # elements per loop iteration of a program
NUM_WARPS = 4
_table_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_CACHE_SIZE = 16


@triton.jit
def _bf16_to_f32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(x):
    # Round to nearest even on the bit pattern (c10's round_to_nearest_even); NaN
    # becomes the canonical bf16 NaN 0x7FC0 as in torch.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, n, decay, neg_step, bc2_sqrt, beta2,
                 one_minus_beta2, lerp_w, eps, LERP_SMALL: tl.constexpr, P_BF16: tl.constexpr,
                 G_BF16: tl.constexpr, HAS_MASTER: tl.constexpr, MASKED: tl.constexpr):
    # MASKED=False for the elements of full chunks: without a mask (and with the
    # alignment hints of the caller) loads and stores become 16-byte vector ops.
    if MASKED:
        mask = offs < n
    else:
        mask = None
    if G_BF16:
        g = _bf16_to_f32(_load(g_ptr + offs, mask, MASKED))
    else:
        g = _load(g_ptr + offs, mask, MASKED)
    m = _load(m_ptr + offs, mask, MASKED)
    v = _load(v_ptr + offs, mask, MASKED)
    p = _load(w_ptr + offs, mask, MASKED)
    if LERP_SMALL:
        m = tl.fma(lerp_w, g - m, m)
    else:
        m = tl.fma(lerp_w, g - m, g)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p * decay + tl.math.div_rn(neg_step * m, denom)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(w_ptr + offs, p, mask=mask)
    if HAS_MASTER:
        if P_BF16:
            tl.store(p_ptr + offs, _f32_to_bf16(p), mask=mask)
        else:
            tl.store(p_ptr + offs, p, mask=mask)


@triton.jit
def _adamw_kernel(PTRS, SCAL, CHUNKS, LERP_SMALL: tl.constexpr, P_BF16: tl.constexpr,
                  G_BF16: tl.constexpr, HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t = tl.load(CHUNKS + 2 * c)
    start = tl.load(CHUNKS + 2 * c + 1)
    row = PTRS + t * 6  # int64: param, grad, exp_avg, exp_avg_sq, master, numel
    n = tl.load(row + 5)
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if P_BF16:
        p_ptr = tl.load(row + 0).to(tl.pointer_type(tl.uint16))
    else:
        p_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
    if G_BF16:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.uint16))
    else:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    w_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))  # master (or param) fp32
    if ALIGNED:  # the host checked that every address is a multiple of 16 bytes
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
    srow = SCAL + t * 7  # float32: the 7 constants of tensor_lists.scalars
    decay = tl.load(srow + 0)
    neg_step = tl.load(srow + 1)
    bc2_sqrt = tl.load(srow + 2)
    beta2 = tl.load(srow + 3)
    one_minus_beta2 = tl.load(srow + 4)
    lerp_w = tl.load(srow + 5)
    eps = tl.load(srow + 6)
    if start + CHUNK <= n:
        for i in range(0, CHUNK, BLOCK):
            offs = tl.max_contiguous(tl.multiple_of(start + i + tl.arange(0, BLOCK), BLOCK), BLOCK)
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, n, decay, neg_step, bc2_sqrt,
                         beta2, one_minus_beta2, lerp_w, eps, LERP_SMALL, P_BF16, G_BF16,
                         HAS_MASTER, MASKED=False)
    else:  # the tensor's last, partial chunk
        for i in range(0, CHUNK, BLOCK):
            offs = tl.max_contiguous(tl.multiple_of(start + i + tl.arange(0, BLOCK), BLOCK), BLOCK)
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, n, decay, neg_step, bc2_sqrt,
                         beta2, one_minus_beta2, lerp_w, eps, LERP_SMALL, P_BF16, G_BF16,
                         HAS_MASTER, MASKED=True)


def _tables(idx: list[int], lists: TensorLists, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pointer/size table, chunk table) on the device for the tensors ``idx``."""
    masters = lists.masters()
    rows = [(lists.params[i].data_ptr(), lists.grads[i].data_ptr(),
             lists.exp_avgs[i].data_ptr(), lists.exp_avg_sqs[i].data_ptr(),
             masters[i].data_ptr(), lists.params[i].numel()) for i in idx]
    key = (lists.device, chunk, tuple(rows))
    if key not in _table_cache:
        chunks = [(j, start) for j, row in enumerate(rows) for start in range(0, row[5], chunk)]
        device = lists.device
        tables = (torch.tensor(rows, dtype=torch.int64).to(device),
                  torch.tensor(chunks, dtype=torch.int64).reshape(-1, 2).to(device))
        if len(_table_cache) >= _CACHE_SIZE:
            _table_cache.pop(next(iter(_table_cache)))
        _table_cache[key] = tables
    return _table_cache[key]


def adamw_multi_tensor_(lists: TensorLists, *, chunk: int = CHUNK, block: int = BLOCK) -> None:
    """One AdamW step over ``lists`` (see tensor_lists), one launch per dtype pair.
    ``chunk`` (a multiple of ``block``) is only changed by tests, to make the
    interpreter cover many chunks with small tensors."""
    if chunk % block:
        raise ValueError(f"chunk={chunk} must be a multiple of block={block}")
    consts = scalars(lists)
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (p, g) in enumerate(zip(lists.params, lists.grads)):
        if p.numel():
            groups.setdefault((p.dtype, g.dtype), []).append(i)
    small = lerp_small(lists.beta1)
    for (p_dtype, g_dtype), idx in groups.items():
        ptrs, chunks = _tables(idx, lists, chunk)
        scal = torch.tensor([consts[i] for i in idx], dtype=torch.float32).to(lists.device)
        aligned = all(t.data_ptr() % 16 == 0 for i in idx for t in _operands(lists, i))
        _adamw_kernel[(chunks.shape[0],)](
            ptrs, scal, chunks, LERP_SMALL=small, P_BF16=p_dtype == torch.bfloat16,
            G_BF16=g_dtype == torch.bfloat16, HAS_MASTER=lists.master_params is not None,
            ALIGNED=aligned, CHUNK=chunk, BLOCK=block, num_warps=NUM_WARPS,
            enable_fp_fusion=False)


def _operands(lists: TensorLists, i: int) -> tuple[torch.Tensor, ...]:
    return (lists.params[i], lists.grads[i], lists.exp_avgs[i], lists.exp_avg_sqs[i],
            lists.masters()[i])
