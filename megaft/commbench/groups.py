"""Who measures with whom: hosts of the ranks, and the scopes whose groups are timed.

A scope is a set of disjoint groups that run a collective at the same time, as in
training (every tp group reduces at once). Scopes, in order:

- intra_node: the ranks of each host;
- inter_node: the i-th rank of every host, for each i (one rank per node, every NIC busy);
- tp, cp, dp, pp: the grid's real process groups (megaft.parallel.grid, tp fastest);
- ep: the grid's expert-parallel groups (parallel.ep consecutive dp x cp replicas, tp apart),
  where a mixture of experts' tokens go all-to-all (megaft.commbench.ep).

A scope whose groups equal an earlier scope's is not measured again (`same_as`): with
8 ranks a node and tp=8, tp is intra_node. `spans` says whether a scope's groups stay
within a node or cross nodes, read from the gathered host names.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megaft.commbench.hooks import Hooks
from megaft.parallel.grid import ParallelGrid


@dataclass
class Scope:
    name: str
    groups: list[list[int]]  # global ranks of every group of the scope (each of >= 2 ranks)
    group: Optional[dist.ProcessGroup] = None  # this rank's group; None when it is in none
    members: list[int] = field(default_factory=list)  # global ranks of this rank's group
    spans: str = ""  # "within a node" | "across nodes" | "mixed"
    same_as: Optional[str] = None  # an earlier scope with the same groups (measured there)
    note: str = ""  # why a scope is empty

    def describe(self) -> dict:
        return {"name": self.name, "groups": self.groups, "group_size": len(self.groups[0]) if self.groups else 0,
                "spans": self.spans, "same_as": self.same_as, "note": self.note}


def gather_hosts(hooks: Hooks) -> list[str]:
    """The host name of every rank, in rank order (an all_gather over the world)."""
    rank = dist.get_rank()
    mine = hooks.hostname(rank) if hooks.hostname else socket.gethostname()
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, mine)
    return hosts


def ranks_by_host(hosts: list[str]) -> dict[str, list[int]]:
    """{host: its ranks}, hosts in the order of their first rank."""
    out: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        out.setdefault(host, []).append(rank)
    return out


def node_groups(hosts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """(intra-node groups, inter-node groups), each of >= 2 ranks."""
    by_host = list(ranks_by_host(hosts).values())
    intra = [ranks for ranks in by_host if len(ranks) >= 2]
    depth = max(len(ranks) for ranks in by_host)
    inter = [[ranks[i] for ranks in by_host if len(ranks) > i] for i in range(depth)]
    return intra, [g for g in inter if len(g) >= 2]


def spans(groups: list[list[int]], hosts: list[str]) -> str:
    inside = [len({hosts[r] for r in g}) == 1 for g in groups]
    return "within a node" if all(inside) else "across nodes" if not any(inside) else "mixed"


def grid_groups(grid: ParallelGrid) -> dict[str, list[list[int]]]:
    """Every group of each grid axis as global ranks: arange(world).view(pp, dp, cp, tp)."""
    ranks = torch.arange(grid.world_size).view(grid.pp_size, grid.dp_size, grid.cp_size, grid.tp_size)
    return {axis: ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
            for axis, dim in (("tp", 3), ("cp", 2), ("dp", 1), ("pp", 0))}


def ep_groups(grid: ParallelGrid) -> list[list[int]]:
    """The ep groups as global ranks, as ParallelGrid.build makes them: the dp x cp replicas of
    each (pp, tp) position (dp major), cut into runs of ep; [] when parallel.ep = 1."""
    if grid.ep_size <= 1:
        return []
    ranks = torch.arange(grid.world_size).view(grid.pp_size, grid.dp_size, grid.cp_size, grid.tp_size)
    return ranks.permute(0, 3, 1, 2).reshape(-1, grid.ep_size).tolist()


def _new_groups(groups: list[list[int]], rank: int, timeout) -> tuple[Optional[dist.ProcessGroup], list[int]]:
    """Create every group on every rank, in the same order (new_group is collective); keep ours."""
    mine, members = None, []
    for g in groups:
        pg = dist.new_group(g, timeout=timeout)
        if rank in g:
            mine, members = pg, g
    return mine, members


def build_scopes(grid: ParallelGrid, hosts: list[str]) -> list[Scope]:
    """The scopes of this world (every rank calls it, in the same order)."""
    rank, world = grid.rank, grid.world_size
    by_host = ranks_by_host(hosts)
    intra, inter = node_groups(hosts)
    scopes = []
    for name, groups, empty in (
            ("intra_node", intra, f"no host has 2 or more of the {world} ranks"),
            ("inter_node", inter, f"all {world} ranks are on one host ({hosts[0]}): nothing crosses a node"
             if len(by_host) == 1 else "fewer than 2 hosts")):
        group, members = _new_groups(groups, rank, grid.timeout)
        scopes.append(Scope(name, groups, group, members, spans(groups, hosts) if groups else "",
                            note="" if groups else empty))
    axis_group = {"tp": grid.tp_group, "cp": grid.cp_group, "dp": grid.dp_group, "pp": grid.pp_group}
    for axis, groups in grid_groups(grid).items():
        if len(groups[0]) < 2:
            scopes.append(Scope(axis, [], note=f"parallel.{axis}=1: no {axis} group to measure"))
            continue
        members = next(g for g in groups if rank in g)
        scopes.append(Scope(axis, groups, axis_group[axis], members, spans(groups, hosts)))
    groups = ep_groups(grid)
    if groups:
        members = next(g for g in groups if rank in g)
        scopes.append(Scope("ep", groups, grid.ep_group, members, spans(groups, hosts)))
    else:
        scopes.append(Scope("ep", [], note="parallel.ep=1: no ep group to measure"))
    for i, scope in enumerate(scopes):  # identical groups: measured once, under the first name
        key = sorted(map(sorted, scope.groups))
        scope.same_as = next((s.name for s in scopes[:i] if s.groups and sorted(map(sorted, s.groups)) == key), None)
    return scopes
