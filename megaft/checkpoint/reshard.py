"""Resharding on load: resume a checkpoint saved at one tp/pp/dp at another (parallel.zero=0).

Every shard carries an index of its flat buffers (`param_index`): for each parameter
its global name, local shape, offset in its buffer and tensor-parallel split
(megaft.layers.shard.TPShard). Names are global under pp too (StageModel keeps
Llama's names), so a parameter is found whichever pipeline stage saved it.
Loading at a new layout (`load_resharded`): every rank reads the shards of saved
dp replica 0, and for each of its own parameters joins the saved tp pieces along
the split dim (padding dropped) into the full tensor, then cuts its new tp piece
(padding re-added as zeros). AdamW's moments use the same offsets (zero=0 keeps them
as full buffers), so they move with their parameters. Every rank reads every
needed shard: fine for the models this repo fine-tunes on a node, not for 70B.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

from megaft.checkpoint import io
from megaft.layers.shard import local_from_full, shard_of

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _offset(view: torch.Tensor, base: torch.Tensor) -> int:
    return (view.data_ptr() - base.data_ptr()) // base.element_size()


def param_index(model: nn.Module, flat) -> list[list[dict[str, Any]]]:
    """Per flat group, per parameter: name, shape, offset and tp split (saved with each shard)."""
    names = {id(p): name for name, p in model.named_parameters()}
    index = []
    for group in flat.groups:
        entries = []
        for p in group.params:
            spec = shard_of(p)
            entries.append({"name": names[id(p)], "shape": tuple(p.shape), "offset": _offset(p.data, group.data),
                            "split": None if spec is None else (spec.dim, spec.full, spec.padded)})
        index.append(entries)
    return index


class _Saved:
    """The named tensors (params and moments) of the saved shards of dp replica 0."""

    def __init__(self, path: str, manifest: dict[str, Any]):
        world = manifest["layout"]["world_size"]
        self.tp = manifest["layout"]["tp"]
        self.pieces: dict[str, dict[int, dict[str, Any]]] = {}  # name -> saved tp rank -> piece
        self.first: Optional[dict[str, Any]] = None
        for rank in range(world):
            state = torch.load(os.path.join(path, io.shard_name(rank)), map_location="cpu", weights_only=False)
            if "index" not in state:
                raise ValueError(f"{path} has no parameter index (saved by an older megaft)")
            if any(m.shape != d.shape for m, d in zip(state["exp_avg"], state["params"])):
                raise ValueError("resharding needs parallel.zero=0, and this checkpoint was saved with ZeRO "
                                 "(optimizer moments sharded over dp)")
            coords = state["coords"]
            if coords["dp_rank"] != 0:
                continue  # dp replicas hold the same values (zero=0)
            if self.first is None:
                self.first = state
            for g, entries in enumerate(state["index"]):
                for e in entries:
                    n = int(torch.Size(e["shape"]).numel())
                    lo, hi = e["offset"], e["offset"] + n
                    piece = {k: state[k][g][lo:hi].view(e["shape"]) for k in ("params",) + _MOMENTS}
                    piece["split"] = e["split"]
                    self.pieces.setdefault(e["name"], {})[coords["tp_rank"]] = piece

    def full(self, name: str, key: str) -> torch.Tensor:
        """The whole, unpadded tensor `key` (params/exp_avg/exp_avg_sq) of parameter `name`."""
        by_tp = self.pieces[name]
        split = by_tp[0]["split"]
        if split is None:
            return by_tp[0][key]  # replicated over tp
        dim, full, padded = split
        local = padded // self.tp
        parts = []
        for tp_rank in range(self.tp):
            real = max(0, min(local, full - tp_rank * local))  # rows of this piece that exist (no padding)
            parts.append(by_tp[tp_rank][key].narrow(dim, 0, real))
        return torch.cat(parts, dim)


def load_resharded(path: str, manifest: dict[str, Any], model: nn.Module, flat, optimizer, grid) -> int:
    """Fill this rank's buffers from a checkpoint of another layout; returns its step."""
    if any(tuple(m.shape) != tuple(g.data.shape) for m, g in zip(optimizer.exp_avg, flat.groups)):
        raise ValueError("resharding needs parallel.zero=0 (full optimizer buffers on every rank); fix: resume "
                         "at parallel.zero=0, or at the layout the checkpoint was saved with")
    saved = _Saved(path, manifest)
    names = {id(p): name for name, p in model.named_parameters()}
    with torch.no_grad():
        for g, group in enumerate(flat.groups):
            for p in group.params:
                name = names[id(p)]
                if name not in saved.pieces:
                    raise ValueError(f"parameter {name} is not in checkpoint {path}; fix: resume with the model "
                                     "config the checkpoint was saved with")
                off, n = _offset(p.data, group.data), p.numel()
                targets = {"params": p.data, "exp_avg": optimizer.exp_avg[g][off:off + n].view_as(p),
                           "exp_avg_sq": optimizer.exp_avg_sq[g][off:off + n].view_as(p)}
                for key, dst in targets.items():
                    full = saved.full(name, key)
                    local = local_from_full(full, p, grid.tp_rank, grid.tp_size) if shard_of(p) else full
                    if tuple(local.shape) != tuple(dst.shape):
                        raise ValueError(f"parameter {name}: checkpoint holds {tuple(full.shape)}, which does not "
                                         f"fit this model's {tuple(dst.shape)} shard; fix: the same model config")
                    dst.copy_(local)
    first = saved.first
    optimizer.step_count = first["step_count"]
    if getattr(optimizer, "scaler", None) and first.get("scaler"):
        optimizer.scaler.load_state_dict(first["scaler"])
    torch.set_rng_state(first["rng"]["cpu"])  # dropout streams differ from the saved layout's anyway
    return int(first["step"])
