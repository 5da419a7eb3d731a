"""A checkpoint never runs code: shards are unpickled weights-only (issue 29).

The attack: a shard holding an object whose __reduce__ calls os.system, with the manifest's
size and sha256 updated to match, so every integrity check passes. Before, megaft-train
resumed it with exit 0 and the command ran."""
import os

import pytest
import torch
from checkpoint_cases import train

from megaft.checkpoint import io
from megaft.checkpoint.io import UnsafeCheckpointError


class RunsACommand:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(ckpt_dir: str, marker: str) -> str:
    """Add the payload to rank 0's shard and re-sign the manifest; the shard's path."""
    path = os.path.join(ckpt_dir, io.shard_name(0))
    state = torch.load(path, weights_only=True)
    torch.save({**state, "extra": RunsACommand(marker)}, path)
    manifest = io.read_manifest(ckpt_dir)
    meta = {k: v for k, v in manifest.items() if k not in ("format", "step", "layout", "files")}
    io.write_manifest(ckpt_dir, manifest["step"], manifest["layout"], meta)
    assert io.problem(ckpt_dir) is None  # the integrity checks pass: only the unpickler can refuse it
    return path


def test_a_planted_shard_is_refused_and_nothing_runs(tmp_path):
    run, marker = str(tmp_path / "run"), str(tmp_path / "pwned")
    train(run, save_every=5, stop_after=5)
    path = plant(io.step_dir(os.path.join(run, "checkpoints"), 5), marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        train(run, save_every=5)  # resume
    message = str(info.value)
    assert message.startswith(f"{path}: refused: it holds posix.system") and "fix:" in message, message
    assert not os.path.exists(marker)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):  # the resharding path reads it mmap'ed
        io.load_shard(os.path.dirname(path), 0, mmap=True)
    assert not os.path.exists(marker)


def test_a_shard_megaft_wrote_loads_weights_only(tmp_path):
    # what capture() writes (tensors, RNG state, layout, index, ranges) is inside the allowlist
    run = str(tmp_path / "run")
    train(run, save_every=5, stop_after=5)
    state = io.load_shard(io.step_dir(os.path.join(run, "checkpoints"), 5), 0)
    assert state["step"] == 5 and state["index"] and isinstance(state["rng"]["cpu"], torch.Tensor)
