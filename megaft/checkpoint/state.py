"""What a rank saves and loads, and the save/resume protocol across ranks.

A rank's shard holds its flat fp32 parameter buffers (FlatParams groups, i.e. its
tp shard of every weight), AdamW's exp_avg/exp_avg_sq/step_count, its RNG states
and the step. The data stream and the LR schedule are pure functions of the
step, so the step is the whole data position. The layout (tp/dp/pp, world size
and this rank's coordinates) and an index of the flat buffers (names, offsets, tp
splits, the ranges its ZeRO-sharded moments cover) are saved too: loading at another
layout or ZeRO stage reshards (megaft.checkpoint.reshard) or is refused with a clear error.

Protocol (every rank calls both functions; all collectives are over the world):
save: rank 0 makes `step_N.tmp/` -> barrier -> each rank writes its shard ->
barrier -> rank 0 writes the manifest, renames to `step_N/`, prunes -> barrier.
resume: rank 0 alone verifies checksums and picks the newest complete
checkpoint, broadcasts its step; every rank checks the layout and loads its shard.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from megaft.checkpoint import io
from megaft.checkpoint.reshard import load_resharded, moment_ranges
from megaft.optim import AdamW, FlatParams
from megaft.parallel.grid import ParallelGrid


class LayoutMismatchError(RuntimeError):
    """The checkpoint was saved with another parallel layout and cannot be resharded into this one."""


def layout(grid: ParallelGrid) -> dict[str, int]:
    return {"tp": grid.tp_size, "dp": grid.dp_size, "pp": grid.pp_size, "world_size": grid.world_size}


def capture(flat: FlatParams, optimizer: AdamW, grid: ParallelGrid, step: int) -> dict[str, Any]:
    """This rank's shard: parameters, optimizer state, RNG states and position (CPU tensors)."""
    rng = {"cpu": torch.get_rng_state()}
    if grid.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(grid.device)
    gatherer = getattr(optimizer, "gatherer", None)  # ZeRO-3: gather the params to save them whole
    if gatherer is not None:
        gatherer.acquire_all()
    # a copy under ZeRO-3: on CPU .cpu() would alias the buffers that release_all() frees
    params = [g.data.to("cpu", copy=gatherer is not None) for g in flat.groups]
    if gatherer is not None:
        gatherer.release_all()
    return {
        "step": step,
        "layout": layout(grid),
        "coords": {"rank": grid.rank, "tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank, "pp_rank": grid.pp_rank},
        "params": params,
        "exp_avg": [m.cpu() for m in optimizer.exp_avg],
        "exp_avg_sq": [v.cpu() for v in optimizer.exp_avg_sq],
        "moments": moment_ranges(optimizer),  # which buffer ranges the moments cover (ZeRO: owned chunks)
        "zero": getattr(optimizer, "stage", 0),
        "step_count": optimizer.step_count,
        "scaler": optimizer.scaler.state_dict() if getattr(optimizer, "scaler", None) else None,  # fp16
        "rng": rng,
    }


def restore(state: dict[str, Any], flat: FlatParams, optimizer: AdamW, grid: ParallelGrid) -> int:
    """Copy a shard into the live buffers (in place: params are views into them); returns its step."""
    want = [tuple(g.data.shape) for g in flat.groups]
    got = [tuple(t.shape) for t in state["params"]]
    if want != got:
        raise ValueError(f"checkpoint parameter buffers have shapes {got}, this model has {want}; fix: resume "
                         "with the model config the checkpoint was saved with")
    want = [tuple(m.shape) for m in optimizer.exp_avg]
    got = [tuple(t.shape) for t in state["exp_avg"]]
    if want != got:  # ZeRO shards the moments over dp: another stage, another shape
        raise ValueError(f"checkpoint optimizer state has shapes {got}, this run {want} (parallel.zero or "
                         "parallel.bucket_mb differs); fix: resume with the parallel.zero and parallel.bucket_mb "
                         "the checkpoint was saved with")
    gatherer = getattr(optimizer, "gatherer", None)  # ZeRO-3: load whole buffers, keep own chunks
    if gatherer is not None:
        gatherer.acquire_all()
    with torch.no_grad():
        for dst, src in zip([g.data for g in flat.groups] + optimizer.exp_avg + optimizer.exp_avg_sq,
                            state["params"] + state["exp_avg"] + state["exp_avg_sq"]):
            dst.copy_(src)
    if gatherer is not None or getattr(optimizer, "offload", False):  # own chunks / host masters (offload)
        optimizer.reload_param_shards()
    if gatherer is not None:
        gatherer.release_all()
    optimizer.step_count = state["step_count"]
    if getattr(optimizer, "scaler", None) and state.get("scaler"):
        optimizer.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and grid.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], grid.device)
    return int(state["step"])


def check_layout(saved: dict[str, int], grid: ParallelGrid, path: str,
                 why: str = "resharding needs the model (megaft.checkpoint.reshard)") -> None:
    """Raise LayoutMismatchError unless `saved` (a manifest's layout) matches this run's grid."""
    now = layout(grid)
    if saved == now:
        return

    def fmt(d: dict[str, int]) -> str:
        return " ".join(f"{k}={d[k]}" for k in ("tp", "dp", "pp"))

    raise LayoutMismatchError(
        f"checkpoint {path} was saved with {fmt(saved)} (world size {saved['world_size']}), resuming with "
        f"{fmt(now)} (world size {now['world_size']}): {why}; fix: resume with "
        f"parallel.tp={saved['tp']} parallel.dp={saved['dp']} parallel.pp={saved['pp']}, or start in a new run "
        "directory, or set train.resume=false")


def barrier(grid: ParallelGrid) -> None:
    if grid.world_size > 1:
        dist.barrier()


def prepare(root: str, step: int, grid: ParallelGrid) -> str:
    """Rank 0 makes an empty `step_N.tmp/`; returns it on every rank (one barrier, all ranks)."""
    tmp = io.step_dir(root, step) + ".tmp"
    if grid.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a run that died mid-save
        os.makedirs(tmp)
    barrier(grid)  # the directory exists before anyone writes into it
    return tmp


def write_shard(tmp: str, state: dict[str, Any], rank: int) -> None:
    """This rank's shard, flushed to disk (no collectives: the async writer's thread calls it)."""
    with open(os.path.join(tmp, io.shard_name(rank)), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def publish(root: str, step: int, tmp: str, saved_layout: dict[str, int], *, keep_last: int) -> str:
    """Rank 0 only, once every shard is on disk: manifest, atomic rename, prune."""
    final = io.step_dir(root, step)
    io.write_manifest(tmp, step, saved_layout)
    io.publish(tmp, final)
    io.prune(root, keep_last)
    return final


def save(root: str, step: int, state: dict[str, Any], grid: ParallelGrid, *, keep_last: int) -> str:
    """Write this rank's `state` into checkpoint `step` under root; all ranks must call it."""
    tmp = prepare(root, step, grid)
    write_shard(tmp, state, grid.rank)
    barrier(grid)  # every shard is on disk before the manifest vouches for it
    if grid.rank == 0:
        publish(root, step, tmp, layout(grid), keep_last=keep_last)
    barrier(grid)  # nobody races ahead (e.g. into the next save or a resume) before it is visible
    return io.step_dir(root, step)


def _agree(step: int, grid: ParallelGrid) -> int:
    """Rank 0's `step`, on every rank (a one-element broadcast over the world)."""
    if grid.world_size == 1:
        return step
    t = torch.tensor([step], dtype=torch.int64, device=grid.device)
    dist.broadcast(t, src=0)
    return int(t.item())


def load_latest(root: str, flat: FlatParams, optimizer: AdamW, grid: ParallelGrid,
                model: Optional[torch.nn.Module] = None) -> Optional[int]:
    """Load the newest complete checkpoint under root into this rank; its step, or None if none.

    Only rank 0 reads every byte (checksums); the others trust its choice. A checkpoint
    of another tp/pp/dp layout, ZeRO stage or bucket size is resharded when `model` is given.
    """
    step = -1
    if grid.rank == 0:
        found, _ = io.find_latest(root)
        step = found[0] if found else -1
    step = _agree(step, grid)
    if step < 0:
        return None
    path = io.step_dir(root, step)
    manifest = io.read_manifest(path)
    same = manifest["layout"] == layout(grid)
    if same:
        state = torch.load(os.path.join(path, io.shard_name(grid.rank)), map_location="cpu", weights_only=False)
        if model is None or _fits(state, flat, optimizer):
            return restore(state, flat, optimizer, grid)  # bitwise; a clear error when it does not fit
    elif model is None:
        check_layout(manifest["layout"], grid, path)  # raises
    try:  # another tp/pp/dp, ZeRO stage or bucket size
        return load_resharded(path, manifest, model, flat, optimizer, grid)
    except ValueError as exc:
        if same:
            raise ValueError(f"checkpoint {path} cannot be resharded into this run's parallel.zero="
                             f"{getattr(optimizer, 'stage', 0)}: {exc}") from exc
        check_layout(manifest["layout"], grid, path, why=f"cannot reshard: {exc}")
        raise


def _fits(state: dict[str, Any], flat: FlatParams, optimizer: AdamW) -> bool:
    """The shard has this rank's exact buffer layout (same ZeRO stage and buckets): restore bitwise."""
    shapes = [tuple(t.shape) for t in state["params"] + state["exp_avg"]]
    return (state.get("zero", getattr(optimizer, "stage", 0)) == getattr(optimizer, "stage", 0)
            and shapes == [tuple(g.data.shape) for g in flat.groups] + [tuple(m.shape) for m in optimizer.exp_avg])


def trim_metrics(path: str, step: int) -> int:
    """Drop metrics.jsonl lines of steps after `step` (written after the checkpoint, before a
    crash) so the resumed run's lines continue the curve without duplicates; returns lines dropped.

    Rewritten in place: the run's MetricsLog may already hold it open for appending.
    """
    if not os.path.isfile(path):
        return 0
    with open(path, "r+") as f:
        lines = f.readlines()
        keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
        if len(keep) != len(lines):
            f.seek(0)
            f.writelines(keep)
            f.truncate()
    return len(lines) - len(keep)
