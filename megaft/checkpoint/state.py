"""What a rank saves and loads, and the save/resume protocol across ranks.

A rank's shard holds its flat fp32 parameter buffers (FlatParams groups, i.e. its
tp shard of every weight), AdamW's exp_avg/exp_avg_sq/step_count, its RNG states
and the step. The data stream and the LR schedule are pure functions of the
step, so the step is the whole data position. The layout (tp/dp/pp, cp and ep when > 1,
world size and this rank's coordinates) and an index of the flat buffers (names, offsets, tp
splits, the ranges its ZeRO-sharded moments cover) are saved too: loading at another
layout or ZeRO stage reshards (megaft.checkpoint.reshard) or is refused with a clear error.
With `optim.master_weights` the parameter buffers are bf16 and the shard adds the fp32
`masters` (laid out like the moments), so a same-layout resume is bitwise.
With `parallel.grad_compression=powersgd` the shard also holds the rank's PowerSGD state
(Q's, error feedback, warm-up start): restored bitwise at the same layout, restarted
(with a CheckpointWarning) where it cannot be mapped, see `restore_compression`.

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
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from megaft.checkpoint import io
from megaft.checkpoint.adapters import check_lora_base
from megaft.checkpoint.io import CheckpointWarning
from megaft.checkpoint.reshard import load_resharded, moment_ranges, restore_buffers
from megaft.optim.adamw import AdamW
from megaft.parallel.data import FlatParams
from megaft.parallel.grid import ParallelGrid


class LayoutMismatchError(RuntimeError):
    """The checkpoint was saved with another parallel layout and cannot be resharded into this one."""


class ModelMismatchError(ValueError):
    """The checkpoint holds another model (shape or architecture): never resharded, always refused."""


def check_model(manifest: dict[str, Any], expect: Optional[dict[str, Any]], path: str) -> None:
    """Raise ModelMismatchError naming every `model.*` field where the manifest's recorded model
    differs from `expect`; a checkpoint from before models were recorded only gets a warning."""
    if expect is None:
        return
    saved = manifest.get("model")
    if saved is None:
        warnings.warn(f"checkpoint {path} records no model config (written by an older megaft): cannot check that "
                      "it holds this run's model architecture", CheckpointWarning, stacklevel=3)
        return
    diff = [f"model.{k}: checkpoint {saved.get(k)!r}, this run {expect.get(k)!r}"
            for k in sorted(set(saved) | set(expect)) if saved.get(k) != expect.get(k)]
    if diff:
        raise ModelMismatchError(
            f"checkpoint {path} holds another model than this run: {'; '.join(diff)}. Only the parallel layout "
            "(tp, pp, dp, ZeRO) may change on resume; fix: resume with the checkpoint's model settings, or start "
            "in a new run directory (hydra.run.dir), or set train.resume=false to train from scratch here")


def layout(grid: ParallelGrid) -> dict[str, int]:
    """The parallel layout a checkpoint records; `cp` only when > 1 (the layouts of runs
    without context parallelism are what they were before it existed)."""
    out = {"tp": grid.tp_size, "dp": grid.dp_size, "pp": grid.pp_size, "world_size": grid.world_size}
    if grid.cp_size > 1:
        out["cp"] = grid.cp_size
    if grid.ep_size > 1:
        out["ep"] = grid.ep_size
    return out


def capture(flat: FlatParams, optimizer: AdamW, grid: ParallelGrid, step: int, reducer=None) -> dict[str, Any]:
    """This rank's shard: parameters, optimizer state, RNG states, position (CPU tensors) and
    the dp reducer's gradient-compression state when `reducer` is given."""
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
        "coords": {"rank": grid.rank, "tp_rank": grid.tp_rank, "dp_rank": grid.dp_rank, "pp_rank": grid.pp_rank,
                   "cp_rank": grid.cp_rank},
        "params": params,
        "exp_avg": [m.cpu() for m in optimizer.exp_avg],
        "exp_avg_sq": [v.cpu() for v in optimizer.exp_avg_sq],
        "masters": [m.cpu() for m in getattr(optimizer, "masters", [])],  # optim.master_weights: fp32, as moments
        "moments": moment_ranges(optimizer),  # which buffer ranges the moments cover (ZeRO: owned chunks)
        "zero": getattr(optimizer, "stage", 0),
        "step_count": optimizer.step_count,
        "scaler": optimizer.scaler.state_dict() if getattr(optimizer, "scaler", None) else None,  # fp16
        "rng": rng,
        "compression": reducer.compression_state() if reducer is not None else None,  # PowerSGD
        # persistent buffers (DeepSeek-V3's correction biases), by name: identical on every rank holding them
        "buffers": {name: t.detach().to("cpu", copy=True) for name, t in getattr(flat, "buffers", {}).items()},
    }


def restore(state: dict[str, Any], flat: FlatParams, optimizer: AdamW, grid: ParallelGrid, reducer=None) -> int:
    """Copy a shard into the live buffers (in place: params are views into them); returns its step."""
    want = [tuple(g.data.shape) for g in flat.groups]
    got = [tuple(t.shape) for t in state["params"]]
    if want != got:
        raise ValueError(f"checkpoint parameter buffers have shapes {got}, this model has {want}; fix: resume "
                         "with the model config the checkpoint was saved with")
    want = [tuple(m.shape) for m in optimizer.exp_avg + optimizer.exp_avg_sq]
    got = [tuple(t.shape) for t in state["exp_avg"] + state["exp_avg_sq"]]
    if want != got:  # ZeRO shards the moments over dp: another stage, another shape (Muon: no exp_avg_sq)
        raise ValueError(f"checkpoint optimizer state has shapes {got}, this run {want} (parallel.zero, "
                         "parallel.bucket_mb or optim.name differs, or a Muon checkpoint from before its matrices "
                         "kept one state buffer); fix: resume with the parallel.zero, parallel.bucket_mb and "
                         "optim.name the checkpoint was saved with, or load it through the model "
                         "(megaft.checkpoint.reshard converts)")
    masters = getattr(optimizer, "masters", [])
    if [t.dtype for t in state["params"]] != [g.data.dtype for g in flat.groups] or len(masters) != len(
            state.get("masters") or []):
        raise ValueError("checkpoint and run differ in optim.master_weights (bf16 params with fp32 masters or "
                         "fp32 params); fix: resume with the optim.master_weights the checkpoint was saved with, "
                         "or load it through the model (megaft.checkpoint.reshard converts)")
    gatherer = getattr(optimizer, "gatherer", None)  # ZeRO-3: load whole buffers, keep own chunks
    if gatherer is not None:
        gatherer.acquire_all()
    with torch.no_grad():
        for dst, src in zip([g.data for g in flat.groups] + optimizer.exp_avg + optimizer.exp_avg_sq + masters,
                            state["params"] + state["exp_avg"] + state["exp_avg_sq"] + (state.get("masters") or [])):
            dst.copy_(src)
    if gatherer is not None or getattr(optimizer, "offload", False):  # own chunks / host masters (offload)
        optimizer.reload_param_shards()
    if gatherer is not None:
        gatherer.release_all()
    optimizer.step_count = state["step_count"]
    restore_buffers(flat, [state])
    if getattr(optimizer, "scaler", None) and state.get("scaler"):
        optimizer.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and grid.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], grid.device)
    restore_compression(reducer, state.get("compression"), int(state["step"]))
    return int(state["step"])


def restore_compression(reducer, saved: Optional[dict], step: int, why: Optional[str] = None) -> None:
    """Put the saved PowerSGD state back into `reducer` (exact resume) or, when it cannot be
    mapped (`why`: another tp/dp/pp layout or ZeRO stage; or another bucket size or
    powersgd_rank; or none saved), restart it: zero error feedback, the initial Q's, and the
    powersgd_warmup_steps uncompressed steps run again from `step` (a fresh Q is a poor
    basis, and the warm-up is what a new run gets). A CheckpointWarning says so."""
    if reducer is None or getattr(reducer, "powersgd", None) is None:
        return  # nothing to restore (no PowerSGD in this run): a saved state is dropped
    if why is None:
        try:
            if saved is None:
                raise ValueError("the checkpoint holds no PowerSGD state")
            reducer.load_compression_state(saved)
            return
        except ValueError as exc:
            why = str(exc)
    reducer.restart_compression(step)
    warnings.warn(f"PowerSGD state restarted at step {step} ({why}): error feedback zeroed, Q's re-initialized, "
                  f"{reducer.warmup} uncompressed warm-up step(s) from here", CheckpointWarning, stacklevel=2)


def check_layout(saved: dict[str, int], grid: ParallelGrid, path: str,
                 why: str = "resharding needs the model (megaft.checkpoint.reshard)") -> None:
    """Raise LayoutMismatchError unless `saved` (a manifest's layout) matches this run's grid."""
    now = layout(grid)
    if saved == now:
        return

    def fmt(d: dict[str, int], sep: str = " ", prefix: str = "") -> str:
        axes = ("tp", "cp", "dp", "pp") + (("ep",) if "ep" in saved or "ep" in now else ())
        return sep.join(f"{prefix}{k}={d.get(k, 1)}" for k in axes)

    raise LayoutMismatchError(
        f"checkpoint {path} was saved with {fmt(saved)} (world size {saved['world_size']}), resuming with "
        f"{fmt(now)} (world size {now['world_size']}): {why}; fix: resume with "
        f"{fmt(saved, prefix='parallel.')}, or start in a new run directory, or set train.resume=false")


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


def publish(root: str, step: int, tmp: str, saved_layout: dict[str, int], *, keep_last: int,
            meta: Optional[dict[str, Any]] = None) -> str:
    """Rank 0 only, once every shard is on disk: manifest (plus `meta`), atomic rename, prune."""
    final = io.step_dir(root, step)
    io.write_manifest(tmp, step, saved_layout, meta)
    io.publish(tmp, final)
    io.prune(root, keep_last)
    return final


def save(root: str, step: int, state: dict[str, Any], grid: ParallelGrid, *, keep_last: int,
         meta: Optional[dict[str, Any]] = None) -> str:
    """Write this rank's `state` into checkpoint `step` under root; all ranks must call it."""
    tmp = prepare(root, step, grid)
    write_shard(tmp, state, grid.rank)
    barrier(grid)  # every shard is on disk before the manifest vouches for it
    if grid.rank == 0:
        publish(root, step, tmp, layout(grid), keep_last=keep_last, meta=meta)
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
                model: Optional[torch.nn.Module] = None, reducer=None,
                model_config: Optional[dict[str, Any]] = None, lora: Optional[dict[str, Any]] = None) -> Optional[int]:
    """Load the newest complete checkpoint under root into this rank; its step, or None if none.

    Only rank 0 reads every byte (checksums); the others trust its choice. A checkpoint
    of another tp/pp/dp layout, ZeRO stage or bucket size is resharded when `model` is given;
    the `reducer`'s compression state is then restarted (`restore_compression`). `model_config`:
    this run's architecture fields, checked against the manifest's first (`check_model`). `lora`:
    this run's adapter record (megaft.peft.base.lora_record; {} without LoRA, None: unchecked),
    checked against the manifest's (`check_lora_base`: adapters of another base are refused).
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
    check_model(manifest, model_config, path)  # every rank reads the same manifest: all raise together
    check_lora_base(manifest, lora, path)  # adapters of another base: refused (megaft.checkpoint.adapters)
    same = manifest["layout"] == layout(grid)
    if same:
        state = io.load_shard(path, grid.rank)
        if model is None or _fits(state, flat, optimizer):
            return restore(state, flat, optimizer, grid, reducer)  # bitwise; a clear error when it does not fit
    elif model is None:
        check_layout(manifest["layout"], grid, path)  # raises
    try:  # another tp/pp/dp, ZeRO stage or bucket size
        step = load_resharded(path, manifest, model, flat, optimizer, grid)
    except ValueError as exc:
        if same:
            raise ValueError(f"checkpoint {path} cannot be resharded into this run's parallel.zero="
                             f"{getattr(optimizer, 'stage', 0)}: {exc}") from exc
        check_layout(manifest["layout"], grid, path, why=f"cannot reshard: {exc}")
        raise
    moved = ("another parallel.zero or bucket_mb" if same else
             "tp={tp} dp={dp} pp={pp}".format(**manifest["layout"]) + f" cp={manifest['layout'].get('cp', 1)}"
             + f" ep={manifest['layout'].get('ep', 1)}"
             + f" to tp={grid.tp_size} dp={grid.dp_size} pp={grid.pp_size} cp={grid.cp_size} ep={grid.ep_size}")
    restore_compression(reducer, None, step, why=f"resharded from {moved}; the state is per dp rank and per "
                        "bucket layout, it cannot be mapped")
    return step


def _fits(state: dict[str, Any], flat: FlatParams, optimizer: AdamW) -> bool:
    """The shard has this rank's exact buffer layout (same ZeRO stage and buckets): restore bitwise."""
    # exp_avg_sq too: a momentum-only buffer (Muon's matrices) has none, a checkpoint from before it had one
    shapes = [tuple(t.shape) for t in state["params"] + state["exp_avg"] + state["exp_avg_sq"]]
    same_dtypes = [t.dtype for t in state["params"]] == [g.data.dtype for g in flat.groups]  # master_weights
    return (state.get("zero", getattr(optimizer, "stage", 0)) == getattr(optimizer, "stage", 0) and same_dtypes
            and shapes == [tuple(t.shape) for t in [g.data for g in flat.groups] + optimizer.exp_avg
                           + optimizer.exp_avg_sq])


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
