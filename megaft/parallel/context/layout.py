"""Context parallelism (`parallel.cp`): which tokens of every row a cp rank holds, and
which (query, key) pairs of two ranks' tokens attend; the attention itself is the ring
of megaft.parallel.context.ring.

Load balance: the sequence is cut into 2·cp chunks and cp rank i holds chunks i and
2·cp-1-i, so every rank has the same share of causal work (Megatron's zig-zag order).
Every rule of the single-process mask holds on global indices: causal, sliding window,
and with packed documents (`Docs`) the same document only, so a chunk knows its
document boundaries from the whole row's doc ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megaft.parallel.comm import Group, group_rank, group_size


def chunk_index(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global token indices [seq / cp] held by cp rank `rank`: chunks rank and 2·cp-1-rank."""
    c = seq // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([first, torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


@dataclass
class ContextShard:
    """This rank's place in the cp group for one micro-batch: the whole row's length and
    (packed documents) doc ids, from which the mask of any (query rank, key rank) block
    follows. Masks are built once per forward and key rank, not once per layer."""

    group: Group
    seq: int  # tokens of the whole row
    doc_ids: Optional[torch.Tensor] = None  # [batch, seq] of the whole row; None = one causal sequence
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def index(self, rank: Optional[int] = None, device=None) -> torch.Tensor:
        return chunk_index(self.seq, self.size, self.rank if rank is None else rank, device)

    def to(self, device) -> "ContextShard":
        return ContextShard(self.group, self.seq, None if self.doc_ids is None else self.doc_ids.to(device))

    def mask(self, key_rank: int, window: Optional[int], device) -> Optional[torch.Tensor] | bool:
        """Boolean [batch or 1, 1, q, k] (True = attend) of this rank's queries against
        `key_rank`'s keys; None when every pair attends, False when none does."""
        key = (key_rank, window)
        if key not in self._masks:
            iq, ik = self.index(device=device), self.index(key_rank, device=device)
            allowed = ik[None, :] <= iq[:, None]
            if window is not None:
                allowed &= ik[None, :] > iq[:, None] - window
            allowed = allowed[None]
            if self.doc_ids is not None:
                doc = self.doc_ids.to(device)
                allowed = allowed & (doc[:, iq, None] == doc[:, None, ik])
            allowed = allowed.unsqueeze(1)
            self._masks[key] = None if bool(allowed.all()) else (False if not bool(allowed.any()) else allowed)
        return self._masks[key]
