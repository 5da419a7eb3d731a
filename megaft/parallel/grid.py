"""ParallelGrid: the tp/dp/pp process groups of one rank, built once and passed explicitly.

Rank order follows Megatron: tp varies fastest, then dp, then pp, so a rank's
coordinates are `arange(world).view(pp, dp, tp)` and tensor-parallel groups stay
inside a node.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch
import torch.distributed as dist


class Axis(str, Enum):
    TP = "tp"
    DP = "dp"
    PP = "pp"


@dataclass(frozen=True)
class ParallelGrid:
    """Sizes, this rank's coordinates and one process group per axis.

    A group is None only in the single-process grid; collectives treat a None group
    and a group of size 1 as the identity.
    """

    tp_size: int
    dp_size: int
    pp_size: int
    rank: int
    device: torch.device
    backend: str
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    # {first pp rank, last pp rank} of this rank's (dp, tp) position, when it is one of them and pp > 1:
    # tied embedding copies sum their gradients over it (megaft.pipeline.stage.sync_tied_grads).
    embedding_group: Optional[dist.ProcessGroup] = None
    # Collective timeout of every group (launcher.timeout_s); None = torch's default, 30 min for subgroups.
    timeout: Optional[datetime.timedelta] = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.dp_size)

    def size(self, axis: Axis) -> int:
        return {Axis.TP: self.tp_size, Axis.DP: self.dp_size, Axis.PP: self.pp_size}[Axis(axis)]

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelGrid":
        """The grid of a world of one process, without torch.distributed."""
        return cls(tp_size=1, dp_size=1, pp_size=1, rank=0, device=torch.device(device), backend="none")

    @classmethod
    def build(cls, *, tp: int, dp: int, pp: int, device: torch.device | str,
              timeout: Optional[datetime.timedelta] = None) -> "ParallelGrid":
        """Create every group of every axis; torch.distributed must be initialized.

        All ranks call new_group for every group in the same order (a collective
        requirement), keeping only the groups that contain them.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        if tp * dp * pp != world:
            raise ValueError(f"world size {world} != tp*pp*dp = {tp}*{pp}*{dp}")
        ranks = torch.arange(world).view(pp, dp, tp)
        groups = {}
        # Moving `axis` last and flattening the rest enumerates that axis's groups.
        for axis, dim in ((Axis.TP, 2), (Axis.DP, 1), (Axis.PP, 0)):
            for members in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
                group = dist.new_group(members, timeout=timeout)
                if rank in members:
                    groups[axis] = group
        # Megatron's embedding group: the first and last pp stage of each (dp, tp) position.
        for members in (ranks[[0, -1]].reshape(2, -1).t().tolist() if pp > 1 else []):
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                groups["embedding"] = group
        return cls(
            tp_size=tp, dp_size=dp, pp_size=pp, rank=rank, device=torch.device(device),
            backend=dist.get_backend(), tp_group=groups[Axis.TP], dp_group=groups[Axis.DP],
            pp_group=groups[Axis.PP], embedding_group=groups.get("embedding"), timeout=timeout,
        )
