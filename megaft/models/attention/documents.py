"""Packed documents kept apart in attention (data.packing=docs).

A packed row holds several documents; `Docs` says, per token, its position inside its
document (RoPE restarts at 0 in every document) and its document's id in the row. A
query attends to the keys of its own document only, causally, and within the sliding
window if the layer has one. Right padding is one more "document" of its own: it sees
only padding, and has no loss. A document may also see a shared prefix (`prefix_ids`: the
prompt of a preference pair whose two answers follow it in the row, pref.share_prompt): a
tree of depth one; flash-attn's varlen segments cannot say that, so such rows take flex or
the explicit mask. Images (`image_blocks`, Gemma 3): the tokens of one image also see each
other's later tokens (transformers' token_type_ids mask: causal OR same image, then the
sliding window); no varlen segment says that either.

Kernels, first that runs: flash-attn's varlen kernel when the package is installed on a
CUDA device (the documents of a micro-batch laid end to end, `cu_seqlens` marking them);
torch's flex_attention with a block mask built from the same rule (`mask_mod`) on CUDA;
else (CPU) SDPA with an explicit boolean mask [batch, 1, seq, seq]. All compute the same
function; on CPU the tests check flex's forward and the varlen path's layout (through a
torch model of flash_attn_varlen_func) against SDPA's.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megaft.kernels.rope import rope
from megaft.parallel.context.layout import ContextShard


@dataclass
class Docs:
    """Document layout of a micro-batch: both [batch, seq] int64. What attention derives
    from it (masks, RoPE tables, varlen segments) is built once per forward and kept here,
    not once per layer."""

    position_ids: torch.Tensor  # position of each token inside its document (0 at its start)
    doc_ids: torch.Tensor  # document index of each token in its row (padding: an index of its own)
    # Context parallelism: these are this cp rank's tokens of the rows `cp` describes, and
    # attention is the ring over the cp group (megaft.parallel.context.ring); None = whole rows here.
    cp: Optional[ContextShard] = None
    # A shared prefix (preference pairs with pref.share_prompt): each token also sees the earlier
    # tokens of the document whose id this holds (its own id: none more); None = plain documents.
    prefix_ids: Optional[torch.Tensor] = None
    # Images attended bidirectionally (Gemma 3): [batch, seq] the index of the image a token belongs
    # to (a run of image tokens), -1 for text; None = no images.
    image_blocks: Optional[torch.Tensor] = None
    # M-RoPE (Qwen2.5-VL): [batch, seq, head_dim] the position each rotary dimension of a token reads (its
    # temporal, height or width position by mrope_section); None = position_ids for every dimension.
    dim_positions: Optional[torch.Tensor] = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def _once(self, key, build: Callable):
        """build() the first time `key` is asked for; the kept value after that."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def to(self, device) -> "Docs":
        cp = None if self.cp is None else self.cp.to(device)
        prefix = None if self.prefix_ids is None else self.prefix_ids.to(device)
        images = None if self.image_blocks is None else self.image_blocks.to(device)
        dims = None if self.dim_positions is None else self.dim_positions.to(device)
        return Docs(self.position_ids.to(device), self.doc_ids.to(device), cp, prefix, images, dims)

    def padded(self, seq: int) -> "Docs":
        """Right-padded to `seq` tokens (sequence parallel pads ids to a multiple of tp):
        the padding continues as one more document, so it sees nothing real."""
        pad = seq - self.doc_ids.shape[1]
        if pad <= 0:
            return self
        if self.cp is not None:  # config validation keeps cp chunks multiples of tp
            raise ValueError("context-parallel chunks are never padded: data.seq_len / cp must be a multiple of tp")
        last = self.doc_ids.max(dim=1, keepdim=True).values + 1
        prefix = None if self.prefix_ids is None else torch.cat([self.prefix_ids, last.expand(-1, pad)], dim=1)
        images = None if self.image_blocks is None else F.pad(self.image_blocks, (0, pad), value=-1)
        dims = None if self.dim_positions is None else F.pad(self.dim_positions, (0, 0, 0, pad))
        return Docs(F.pad(self.position_ids, (0, pad)), torch.cat([self.doc_ids, last.expand(-1, pad)], dim=1),
                    prefix_ids=prefix, image_blocks=images, dim_positions=dims)

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [b*s, d] at the flattened position_ids (each dimension at its own position
        under M-RoPE: `dim_positions`), gathered once for all layers."""
        if self.dim_positions is not None:
            index = self.dim_positions.reshape(-1, cos.shape[-1])
            return self._once(("rope", cos.data_ptr(), sin.data_ptr()),
                              lambda: (cos.gather(0, index), sin.gather(0, index)))
        flat = self.position_ids.reshape(-1)
        return self._once(("rope", cos.data_ptr(), sin.data_ptr()), lambda: (cos[flat], sin[flat]))

    def segments(self) -> tuple[torch.Tensor, int]:
        """`segments(doc_ids)`, once (its longest segment is read on the host: one sync per forward)."""
        return self._once("segments", lambda: segments(self.doc_ids))

    def mask(self, window: Optional[int], flex: bool):
        """The flex block mask (`flex`) or the SDPA boolean mask for `window`, built once."""
        if not flex:
            return self._once((window, False), lambda: document_mask(self, window))

        def block_mask():
            from torch.nn.attention.flex_attention import create_block_mask

            b, s = self.doc_ids.shape
            return create_block_mask(mask_mod(self, window), b, None, s, s, device=self.doc_ids.device)

        return self._once((window, True), block_mask)


def document_mask(docs: Docs, window: Optional[int] = None) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean (True = attend): same document (or the query's shared
    prefix), causal or within the query's image, and at most `window` keys back (itself
    included) when given."""
    seq = docs.doc_ids.shape[1]
    i = torch.arange(seq, device=docs.doc_ids.device)
    same = docs.doc_ids[:, :, None] == docs.doc_ids[:, None, :]
    if docs.prefix_ids is not None:
        same |= docs.prefix_ids[:, :, None] == docs.doc_ids[:, None, :]
    order = (i[None, :] <= i[:, None]).unsqueeze(0)
    if docs.image_blocks is not None:  # transformers' blockwise_overlay, OR-ed into the causal mask
        blocks = docs.image_blocks
        order = order | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))
    allowed = order & same
    if window is not None:
        allowed &= (i[None, :] > i[:, None] - window).unsqueeze(0)
    return allowed.unsqueeze(1)


def mask_mod(docs: Docs, window: Optional[int] = None):
    """The same rule as `document_mask`, as flex_attention's mask_mod(b, h, q, kv)."""
    doc, prefix, blocks = docs.doc_ids, docs.prefix_ids, docs.image_blocks

    def allowed(b, h, q, kv):
        same = doc[b, q] == doc[b, kv]
        order = kv <= q
        if blocks is not None:
            order = order | ((blocks[b, q] == blocks[b, kv]) & (blocks[b, q] >= 0))
        ok = order & (same if prefix is None else same | (prefix[b, q] == doc[b, kv]))
        return ok & (kv > q - window) if window is not None else ok

    return allowed


def rope_at(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: "Docs",
            backend: str):
    """RoPE of q [b, h, s, d] and k [b, kv, s, d] at the per-token positions `docs.position_ids`
    [b, s], through the rope kernel front of any backend: the rows are laid end to end as one
    sequence of b*s positions whose cos/sin are gathered at the positions (RoPE is per
    token, so exact). The gathered tables are built once per forward (`Docs.rope_tables`):
    every layer's rope saves the same two tensors for backward."""
    b, h, s, d = q.shape

    def one_row(x: torch.Tensor) -> torch.Tensor:  # [b, n, s, d] -> [1, n, b*s, d]
        return x.transpose(0, 1).reshape(1, x.shape[1], b * s, d)

    q2, k2 = rope(one_row(q), one_row(k), *docs.rope_tables(cos, sin), backend)

    def back(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[1], b, s, d).transpose(0, 1)

    return back(q2), back(k2)


@functools.cache
def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def flex_available(device: torch.device) -> bool:
    """flex_attention trains only on CUDA (its CPU path has no backward in torch 2.13)."""
    return device.type == "cuda" and _importable("torch.nn.attention.flex_attention")


def segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [segments + 1], longest segment) of the documents of [batch, seq]
    rows laid end to end: a segment is a run of one doc id within a row."""
    b, s = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    edges = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([b * s], device=doc_ids.device)])
    return edges.to(torch.int32), int((edges[1:] - edges[:-1]).max())


def varlen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Docs, window: Optional[int],
                  fn: Optional[Callable] = None) -> torch.Tensor:
    """Packed-document attention through a varlen kernel (`fn`: flash_attn_varlen_func's
    signature; default flash-attn's): q [b, h, s, d], k/v [b, kv, s, d] (GQA as is)."""
    if fn is None:
        from flash_attn import flash_attn_varlen_func as fn
    b, h, s, d = q.shape
    cu, longest = docs.segments()

    def flat(x: torch.Tensor) -> torch.Tensor:  # [b, n, s, d] -> [b*s, n, d]
        return x.transpose(1, 2).reshape(b * s, x.shape[1], d)

    out = fn(flat(q), flat(k), flat(v), cu, cu, longest, longest, causal=True,
             window_size=(window - 1, 0) if window is not None else (-1, -1))
    return out.reshape(b, s, h, d).transpose(1, 2)


def flash_available(device: torch.device) -> bool:
    return device.type == "cuda" and _importable("flash_attn")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Docs, window: Optional[int],
           gqa: bool) -> torch.Tensor:
    """Attention of packed documents: flash-attn's varlen kernel, else compiled
    flex_attention with a block mask on CUDA, else SDPA with the explicit mask
    (`kernel_name` says which)."""
    if flash_available(q.device) and docs.prefix_ids is None and docs.image_blocks is None:  # no varlen segment
        # says a shared prefix or an image seen both ways
        return varlen_attend(q, k, v, docs, window)
    if flex_available(q.device):
        return _compiled_flex()(q, k, v, block_mask=docs.mask(window, True), enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask(window, False), enable_gqa=gqa)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (uncompiled it materializes the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def kernel_name(device: torch.device, shared_prefix: bool = False) -> str:
    """What `attend` runs on `device` (summary.json's attention record); `shared_prefix`: rows
    with a shared prompt (Docs.prefix_ids, pref.share_prompt), which flash-attn's varlen skips."""
    if flash_available(device) and not shared_prefix:
        return "flash_attn_varlen"
    return "flex_attention" if flex_available(device) else "sdpa_mask"
