"""ParallelGrid: the tp/cp/dp/pp process groups of one rank, built once and passed explicitly.

Rank order follows Megatron: tp varies fastest, then cp, then dp, then pp, so a rank's
coordinates are `arange(world).view(pp, dp, cp, tp)`, tensor-parallel groups stay inside
a node and the cp ring's neighbours are next to them.

Context parallelism splits every sequence over cp, and the parameters are replicated
over it as over dp: gradients and ZeRO shards span the dp×cp `replica_group` (Megatron's
data-parallel group with cp), while the data is split over dp alone.

Expert parallelism (`parallel.ep`, mixtures of experts) splits the routed experts over ep
ranks taken from those replicas (Megatron's rule: ep divides dp·cp): consecutive replica
ranks form an `ep_group` (they exchange tokens by all-to-all), and the ranks holding the
same experts form the `expert_replica_group` (dp·cp/ep ranks: expert gradients and their
ZeRO shards), which is `replica_group` when ep = 1.
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
    CP = "cp"
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
    cp_size: int = 1
    cp_group: Optional[dist.ProcessGroup] = None
    # dp×cp: the ranks holding the same parameters (gradient reduction, ZeRO); dp_group when cp = 1
    replica_group: Optional[dist.ProcessGroup] = None
    ep_size: int = 1
    ep_group: Optional[dist.ProcessGroup] = None
    # the replicas holding this rank's experts (dp·cp/ep ranks); replica_group when ep = 1
    expert_replica_group: Optional[dist.ProcessGroup] = None
    # Collective timeout of every group (launcher.timeout_s); None = torch's default, 30 min for subgroups.
    timeout: Optional[datetime.timedelta] = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp_size * self.cp_size)) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.pp_stride

    @property
    def pp_stride(self) -> int:
        """Global rank distance between neighbouring pipeline stages."""
        return self.tp_size * self.cp_size * self.dp_size

    @property
    def replica_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def replica_rank(self) -> int:
        """Rank in `replica_group` (dp major, cp minor)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def ep_rank(self) -> int:
        """Rank in `ep_group`: which slice of the routed experts this rank holds."""
        return self.replica_rank % self.ep_size

    @property
    def expert_replicas(self) -> int:
        """Size of `expert_replica_group`."""
        return self.replica_size // self.ep_size

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinates, outermost axis first."""
        return self.coords_of(self.rank)

    def coords_of(self, rank: int) -> dict[str, int]:
        """The coordinates of global rank `rank`, outermost axis first."""
        tp, cp = rank % self.tp_size, (rank // self.tp_size) % self.cp_size
        return {"pp": rank // self.pp_stride, "dp": (rank // (self.tp_size * self.cp_size)) % self.dp_size,
                "cp": cp, "tp": tp}

    def size(self, axis: Axis) -> int:
        return {Axis.TP: self.tp_size, Axis.CP: self.cp_size, Axis.DP: self.dp_size,
                Axis.PP: self.pp_size}[Axis(axis)]

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelGrid":
        """The grid of a world of one process, without torch.distributed."""
        return cls(tp_size=1, dp_size=1, pp_size=1, rank=0, device=torch.device(device), backend="none")

    @classmethod
    def build(cls, *, tp: int, dp: int, pp: int, device: torch.device | str, cp: int = 1, ep: int = 1,
              timeout: Optional[datetime.timedelta] = None) -> "ParallelGrid":
        """Create every group of every axis; torch.distributed must be initialized.

        All ranks call new_group for every group in the same order (a collective
        requirement), keeping only the groups that contain them.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        if tp * cp * dp * pp != world:
            raise ValueError(f"world size {world} != tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp}")
        ranks = torch.arange(world).view(pp, dp, cp, tp)
        groups = {}
        # Moving `axis` last and flattening the rest enumerates that axis's groups.
        for axis, dim in ((Axis.TP, 3), (Axis.CP, 2), (Axis.DP, 1), (Axis.PP, 0)):
            if axis == Axis.CP and cp == 1:
                continue  # no cp groups in a run without cp (the same groups as before cp existed)
            for members in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
                group = dist.new_group(members, timeout=timeout)
                if rank in members:
                    groups[axis] = group
        if cp > 1:  # dp×cp replicas of each (pp, tp) position, dp major
            for members in ranks.permute(0, 3, 1, 2).reshape(-1, dp * cp).tolist():
                group = dist.new_group(members, timeout=timeout)
                if rank in members:
                    groups["replica"] = group
        if ep > 1:  # consecutive replicas exchange tokens; every ep-th one holds the same experts
            if (dp * cp) % ep:
                raise ValueError(f"ep={ep} does not divide dp*cp = {dp * cp}")
            for row in ranks.permute(0, 3, 1, 2).reshape(-1, dp * cp // ep, ep):
                for name, members in [("ep", m) for m in row.tolist()] + [("expert", m) for m in row.t().tolist()]:
                    group = dist.new_group(members, timeout=timeout)
                    if rank in members:
                        groups[name] = group
        # Megatron's embedding group: the first and last pp stage of each (dp, cp, tp) position.
        for members in (ranks[[0, -1]].reshape(2, -1).t().tolist() if pp > 1 else []):
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                groups["embedding"] = group
        replicas = groups.get("replica", groups[Axis.DP])
        return cls(
            tp_size=tp, dp_size=dp, pp_size=pp, rank=rank, device=torch.device(device),
            backend=dist.get_backend(), tp_group=groups[Axis.TP], dp_group=groups[Axis.DP],
            pp_group=groups[Axis.PP], embedding_group=groups.get("embedding"), timeout=timeout,
            cp_size=cp, cp_group=groups.get(Axis.CP), replica_group=replicas, ep_size=ep, ep_group=groups.get("ep"),
            expert_replica_group=groups.get("expert", replicas),
        )
