"""Resharding on load: resume a checkpoint saved at one tp/pp/dp/ZeRO stage at another.

Every shard carries an index of its flat buffers (`param_index`): for each parameter
its global name, local shape, offset in its buffer and tensor-parallel split
(megaft.parallel.tensor.shard.TPShard), and where its AdamW moments live (`moment_ranges`:
per buffer, the element ranges [lo, hi) whose moments this rank holds, at `at` in
its moment tensor; zero=0: the whole buffer, ZeRO: its chunk of every bucket). The
parameter buffers themselves are always saved whole (ZeRO-3 gathers them to save).
Names are global under pp too (StageModel keeps Llama's names), so a parameter is
found whichever pipeline stage saved it.

Loading at a new layout (`load_resharded`): every rank reads the shards of saved dp
replica 0 (and, when the moments were ZeRO-sharded, the other dp ranks' shards of
the same tp/pp coordinate, for their chunks of the moments), rebuilds each saved
buffer's full moments from the chunks, and for each of its own parameters joins the
saved tp pieces along the split dim (padding dropped) into the full tensor, then
cuts its new tp piece (padding re-added as zeros). It writes the moments into a
whole buffer of its new layout and keeps its own ranges of it (its new ZeRO chunks).
Shards are memory-mapped, so only the bytes used are read. Every rank reads every
needed shard: fine for the models this repo fine-tunes on a node, not for 70B.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from megaft.checkpoint import io
from megaft.parallel.tensor.shard import expert_slice_of, full_shape, local_from_full, shard_of

_MOMENTS = ("exp_avg", "exp_avg_sq")
# The fp32 values of the params: the saved fp32 masters (optim.master_weights, laid out like the
# moments) or, without them, the fp32 params themselves. Params and masters are both loaded from
# them, so a checkpoint converts either way (bf16 params get the masters rounded to nearest even).
_MASTERS = "masters"


def _offset(view: torch.Tensor, base: torch.Tensor) -> int:
    return (view.data_ptr() - base.data_ptr()) // base.element_size()


def param_index(model: nn.Module, flat) -> list[list[dict[str, Any]]]:
    """Per flat group, per parameter: name, shape, offset, tp split and, for routed experts
    split over ep, the experts held (saved with each shard)."""
    names = {id(p): name for name, p in model.named_parameters()}
    index = []
    for group in flat.groups:
        entries = []
        for p in group.params:
            spec, experts = shard_of(p), expert_slice_of(p)
            entry = {"name": names[id(p)], "shape": tuple(p.shape), "offset": _offset(p.data, group.data),
                     "split": None if spec is None else (spec.dim, spec.full, spec.padded,
                                                         getattr(spec, "replicas", 1))}
            if experts is not None:
                entry["experts"] = (*experts.bounds, experts.experts)
            entries.append(entry)
        index.append(entries)
    return index


def moment_ranges(optimizer) -> list[list[tuple[int, int, int]]]:
    """Per flat group: (lo, hi, at) for each range [lo, hi) of the group's buffer whose Adam
    moments this rank holds, at [at, at + hi - lo) of its exp_avg/exp_avg_sq tensor of the group."""
    chunks = getattr(optimizer, "chunks", None)  # ZeRO 1-3: (bucket, param, grad, exp_avg, exp_avg_sq) views
    if chunks is None:  # zero=0: moments of the whole buffer
        return [[(0, m.numel(), 0)] for m in optimizer.exp_avg]
    out: list[list[tuple[int, int, int]]] = [[] for _ in optimizer.exp_avg]
    for (bucket, _, _, m, _), (lo, hi) in zip(chunks, optimizer.ranges):
        out[bucket.group].append((lo, hi, _offset(m, optimizer.exp_avg[bucket.group])))
    return out


def _ranges(state: dict[str, Any]) -> list[list[tuple[int, int, int]]]:
    if "moments" in state:
        return state["moments"]
    if any(m.shape != p.shape for m, p in zip(state["exp_avg"], state["params"])):
        raise ValueError("this checkpoint holds ZeRO-sharded moments without their ranges (saved by an older "
                         "megaft)")
    return [[(0, m.numel(), 0)] for m in state["exp_avg"]]


def _load(path: str, rank: int) -> dict[str, Any]:
    state = io.load_shard(path, rank, mmap=True)
    if "index" not in state:
        raise ValueError(f"{path} has no parameter index (saved by an older megaft)")
    return state


def _full_moments(shards: list[dict[str, Any]], key: str, ep_rank: int) -> list[torch.Tensor]:
    """Whole moment buffers of one tp/pp coordinate, assembled from its dp×cp ranks' ranges:
    a buffer of routed experts split over ep from the ranks of ep rank `ep_rank` only."""
    out = [torch.zeros(p.numel(), dtype=torch.float32) for p in shards[0]["params"]]  # fp32 even for bf16 params
    for state in shards:
        mine = state["ep_rank"] == ep_rank
        for g, ranges in enumerate(_ranges(state)):
            # a momentum-only buffer (Muon's matrices: megaft.parallel.data.flat) saved no exp_avg_sq: zeros
            if (mine or not _is_expert(state["index"][g])) and state[key][g].numel():
                for lo, hi, at in ranges:
                    out[g][lo:hi] = state[key][g][at:at + hi - lo]
    return out


def _is_expert(entries: list[dict[str, Any]]) -> bool:
    return bool(entries) and "experts" in entries[0]


class _Saved:
    """The named tensors (params and whole moments) of a saved checkpoint, per saved tp rank."""

    def __init__(self, path: str, manifest: dict[str, Any]):
        lay = manifest["layout"]
        self.tp, ep, replicas = lay["tp"], lay.get("ep", 1), lay["dp"] * lay.get("cp", 1)
        # name -> (saved tp rank, saved ep rank) -> piece; ep rank 0 alone for all but split experts
        self.pieces: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
        self.first = _load(path, 0)
        self.shards = [self.first]  # the shards read (their persistent buffers: load_resharded)
        # Rank order: tp fastest, then cp, dp, pp. The dp×cp replicas hold the same parameters;
        # moments sharded over them (ZeRO) need every replica's shard, otherwise replica 0 suffices.
        # (Compared with the whole buffer: a group of one bucket gives rank 0 the single range
        # [0, numel/dp), which starts at 0 and ends at its own moment's length.)
        sharded = any(sum(hi - lo for lo, hi, _ in ranges) != p.numel()
                      for ranges, p in zip(_ranges(self.first), self.first["params"]))
        # Experts split over ep: the first ep replicas hold one slice each.
        coords: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for rank in range(lay["world_size"]):
            if not sharded and (rank // lay["tp"]) % replicas >= ep:
                continue
            state = self.first if rank == 0 else _load(path, rank)
            if rank:
                self.shards.append(state)
            c = state["coords"]
            state["ep_rank"] = (c["dp_rank"] * lay.get("cp", 1) + c.get("cp_rank", 0)) % ep
            coords.setdefault((c["tp_rank"], c["pp_rank"]), []).append(state)
        for (tp_rank, _), shards in coords.items():
            shards.sort(key=lambda s: (s["coords"]["dp_rank"], s["coords"].get("cp_rank", 0)))  # replica order
            for ep_rank in range(ep):
                self._add(tp_rank, ep_rank, shards)

    def _add(self, tp_rank: int, ep_rank: int, shards: list[dict[str, Any]]) -> None:
        """The pieces of saved tp rank `tp_rank` and ep rank `ep_rank` (its experts; the rest at ep rank 0)."""
        first = next(s for s in shards if s["ep_rank"] == ep_rank)
        tensors = {"params": first["params"]}
        tensors.update({k: _full_moments(shards, k, ep_rank) for k in _MOMENTS})
        tensors[_MASTERS] = (_full_moments(shards, _MASTERS, ep_rank) if first.get(_MASTERS)
                             else [p.float() for p in first["params"]])
        for g, entries in enumerate(first["index"]):
            if ep_rank > 0 and not _is_expert(entries):
                continue
            for e in entries:
                lo = e["offset"]
                hi = lo + int(torch.Size(e["shape"]).numel())
                piece = {k: t[g][lo:hi].view(e["shape"]) for k, t in tensors.items()}
                piece["split"] = e["split"]
                self.pieces.setdefault(e["name"], {})[(tp_rank, ep_rank)] = piece

    def full(self, name: str, key: str) -> torch.Tensor:
        """The whole, unpadded tensor `key` (params/exp_avg/exp_avg_sq/masters) of parameter `name`:
        routed experts split over ep joined along dim 0 after each slice's tp pieces."""
        slices = sorted({ep_rank for _, ep_rank in self.pieces[name]})
        return torch.cat([self._tp_joined(name, key, e) for e in slices]) if len(slices) > 1 else \
            self._tp_joined(name, key, 0)

    def _tp_joined(self, name: str, key: str, ep_rank: int) -> torch.Tensor:
        by_tp = {tp: piece for (tp, e), piece in self.pieces[name].items() if e == ep_rank}
        split = by_tp[0]["split"]
        if split is None:
            return by_tp[0][key]  # replicated over tp
        dim, full, padded = split[:3]
        replicas = split[3] if len(split) > 3 else 1  # older checkpoints: no copied kv heads
        if replicas > 1:  # kv heads copied over tp > n_kv_heads (megaft.models.attention.kv_heads): one piece per head
            return torch.cat([by_tp[r][key] for r in range(0, self.tp, replicas)], dim)
        local = padded // self.tp
        parts = []
        for tp_rank in range(self.tp):
            real = max(0, min(local, full - tp_rank * local))  # rows of this piece that exist (no padding)
            parts.append(by_tp[tp_rank][key].narrow(dim, 0, real))
        return torch.cat(parts, dim)


def _fill_group(saved: _Saved, path: str, group, names: dict[int, str], grid) -> dict[str, torch.Tensor]:
    """Copy the group's params into place; returns its whole moment buffers in this layout."""
    whole = {k: torch.zeros(group.data.numel(), dtype=torch.float32) for k in _MOMENTS + (_MASTERS,)}  # zero pads
    for p in group.params:
        name = names[id(p)]
        if name not in saved.pieces:
            raise ValueError(f"parameter {name} is not in checkpoint {path}; fix: resume with the model "
                             "config the checkpoint was saved with")
        off, n = _offset(p.data, group.data), p.numel()
        targets = [(_MASTERS, p.data)]  # rounded into bf16 params, as the optimizer's step does
        targets += [(k, whole[k][off:off + n].view_as(p)) for k in _MOMENTS + (_MASTERS,)]
        want = list(full_shape(p, grid.tp_size))
        for key, dst in targets:
            full = saved.full(name, key)
            if list(full.shape) != want:  # checked whole: cutting a tp piece must not hide a size change
                raise ValueError(f"parameter {name}: checkpoint holds {tuple(full.shape)}, this model "
                                 f"{tuple(want)}; fix: resume with the model config the checkpoint was saved with")
            dst.copy_(local_from_full(full, p, grid.tp_rank, grid.tp_size))
    return whole


@torch.no_grad()
def restore_buffers(flat, states: list[dict[str, Any]]) -> None:
    """Copy the saved persistent buffers into the model's, by name, from whichever of `states`
    (rank shards) holds each; a checkpoint from before buffers were saved leaves them as loaded."""
    for name, t in getattr(flat, "buffers", {}).items():
        saved = next((s["buffers"][name] for s in states if name in (s.get("buffers") or {})), None)
        if saved is not None:
            t.copy_(saved)


def load_resharded(path: str, manifest: dict[str, Any], model: nn.Module, flat, optimizer, grid) -> int:
    """Fill this rank's buffers (any ZeRO stage) from a checkpoint of another layout; returns its step."""
    saved = _Saved(path, manifest)
    names = {id(p): name for name, p in model.named_parameters()}
    gatherer: Optional[Any] = getattr(optimizer, "gatherer", None)  # ZeRO-3: fill whole buffers, keep chunks
    if gatherer is not None:
        gatherer.acquire_all()
    try:
        with torch.no_grad():
            for g, (group, ranges) in enumerate(zip(flat.groups, moment_ranges(optimizer))):
                whole = _fill_group(saved, path, group, names, grid)
                for lo, hi, at in ranges:
                    optimizer.exp_avg[g][at:at + hi - lo].copy_(whole["exp_avg"][lo:hi])
                    if optimizer.exp_avg_sq[g].numel():  # none in a momentum-only buffer (Muon's matrices)
                        optimizer.exp_avg_sq[g][at:at + hi - lo].copy_(whole["exp_avg_sq"][lo:hi])
                    if getattr(optimizer, "masters", None):
                        optimizer.masters[g][at:at + hi - lo].copy_(whole[_MASTERS][lo:hi])
        if hasattr(optimizer, "reload_param_shards"):  # ZeRO-3 chunks, offloaded masters: from the buffers
            optimizer.reload_param_shards()
    finally:
        if gatherer is not None:
            gatherer.release_all()
    first = saved.first
    restore_buffers(flat, saved.shards)
    optimizer.step_count = first["step_count"]
    if getattr(optimizer, "scaler", None) and first.get("scaler"):
        optimizer.scaler.load_state_dict(first["scaler"])
    torch.set_rng_state(first["rng"]["cpu"])  # dropout streams differ from the saved layout's anyway
    return int(first["step"])


def named_tensors(ckpt_dir: str, key: str = "params") -> dict[str, torch.Tensor]:
    """Every parameter's whole, unpadded `key` tensor (params, exp_avg, exp_avg_sq, masters)
    of a published checkpoint, by name, whatever layout wrote it (megaft.verify reads
    the step-1 first moments this way)."""
    saved = _Saved(ckpt_dir, io.read_manifest(ckpt_dir))
    return {name: saved.full(name, key).clone() for name in saved.pieces}
