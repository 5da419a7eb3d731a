"""Checkpoints: atomic publish, manifest checks, keep_last, exact (bitwise) resume, fallback."""
import os
import shutil

import pytest
import torch

from checkpoint_cases import tp2_straight_and_resumed, train
from megaft.checkpoint import CheckpointWarning, LayoutMismatchError, find_latest, io, list_checkpoints, problem
from megaft.training.config import TrainConfig, check_train
from multirank import spawn
from train_cases import read_metrics, read_rows


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 20-step single-process reference run."""
    run_dir = str(tmp_path_factory.mktemp("straight"))
    train(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp2"))
    spawn(2, tp2_straight_and_resumed, root)
    return root


def steps(run_dir):
    return [s for s, _ in list_checkpoints(os.path.join(run_dir, "checkpoints"))]


def assert_same_curve(got_dir, want_dir):
    """Bitwise: same rank layout, same ops in the same order, so every float must be equal."""
    got, got_eval = read_metrics(got_dir)
    want, want_eval = read_metrics(want_dir)
    assert len(got) == len(want) == 20
    assert got == want  # == on floats on purpose: resume must be exact on CPU
    assert [(e["step"], e["eval_loss"]) for e in got_eval] == [(e["step"], e["eval_loss"]) for e in want_eval]


def test_resume_is_bitwise_exact_and_keeps_last_two(straight, tmp_path):
    run = str(tmp_path)
    train(run, save_every=5, keep_last=2, stop_after=10)  # a job stopped after step 10
    assert steps(run) == [5, 10]
    train(run, save_every=5, keep_last=2)  # the requeued job resumes at 10
    assert steps(run) == [15, 20]  # exactly the two newest
    assert_same_curve(run, straight)
    assert [r["step"] for r in read_rows(run) if "eval_loss" in r] == [0, 10, 20]  # no second step-0 eval
    manifest = io.read_manifest(io.step_dir(os.path.join(run, "checkpoints"), 20))
    assert manifest["step"] == 20 and manifest["layout"] == {"tp": 1, "dp": 1, "pp": 1, "world_size": 1}
    assert list(manifest["files"]) == ["rank_00000.pt"]


def test_corrupt_newest_falls_back_to_previous(straight, tmp_path):
    run = str(tmp_path)
    ckpts = os.path.join(run, "checkpoints")
    train(run, save_every=5, keep_last=0, stop_after=10)
    shard = os.path.join(io.step_dir(ckpts, 10), "rank_00000.pt")
    with open(shard, "r+b") as f:  # flip one byte in the middle: same size, bad checksum
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.makedirs(io.step_dir(ckpts, 15) + ".tmp")  # a save that died half-way is invisible
    with pytest.warns(CheckpointWarning, match=r"step_000010: shard rank_00000.pt fails its sha256.*step_000005"):
        train(run, save_every=5, keep_last=0)
    # Lines 6..10 of the first run were dropped on resume and written again by the second.
    assert_same_curve(run, straight)
    assert steps(run) == [5, 10, 15, 20] and problem(io.step_dir(ckpts, 10)) is None  # 10 rewritten


def test_complete_means_manifest_and_every_listed_shard(tmp_path):
    root = str(tmp_path)

    def fake(step, world=1, manifest=True):
        d = io.step_dir(root, step) + ".tmp"
        os.makedirs(d)
        for r in range(world):
            with open(os.path.join(d, io.shard_name(r)), "wb") as f:
                f.write(b"x" * (r + 1))
        if manifest:
            io.write_manifest(d, step, {"tp": world, "dp": 1, "pp": 1, "world_size": world})
        io.publish(d, io.step_dir(root, step))
        return io.step_dir(root, step)

    fake(1, world=2)
    assert problem(io.step_dir(root, 1)) is None
    assert "no manifest.json" in problem(fake(2, manifest=False))
    os.remove(os.path.join(fake(3, world=2), "rank_00001.pt"))
    assert problem(io.step_dir(root, 3)) == "shard rank_00001.pt is missing"
    with open(os.path.join(fake(4), "rank_00000.pt"), "ab") as f:
        f.write(b"more")
    assert "has 5 bytes, manifest.json says 1" in problem(io.step_dir(root, 4))
    os.makedirs(io.step_dir(root, 9) + ".tmp")
    with pytest.warns(CheckpointWarning) as record:
        found, skipped = find_latest(root)
    assert found == (1, io.step_dir(root, 1))
    assert [m.split(": ", 1)[0] for m in skipped] == [f"skipping checkpoint {io.step_dir(root, s)}" for s in (4, 3, 2)]
    assert len(record) == 3
    assert io.prune(root, keep_last=2) == [io.step_dir(root, 1), io.step_dir(root, 2)]
    assert [s for s, _ in list_checkpoints(root)] == [3, 4] and os.path.isdir(io.step_dir(root, 9) + ".tmp")


def test_tp2_resume_is_bitwise_exact(tp2_runs):
    resumed = os.path.join(tp2_runs, "resumed")
    assert_same_curve(resumed, os.path.join(tp2_runs, "straight"))
    assert steps(resumed) == [10, 20]
    manifest = io.read_manifest(io.step_dir(os.path.join(resumed, "checkpoints"), 20))
    assert sorted(manifest["files"]) == ["rank_00000.pt", "rank_00001.pt"]
    shard = torch.load(os.path.join(resumed, "checkpoints", "step_000020", "rank_00001.pt"), weights_only=False)
    assert shard["coords"]["tp_rank"] == 1 and shard["step"] == 20 and shard["step_count"] == 20


def test_layout_mismatch_is_a_clear_error(tp2_runs, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(os.path.join(tp2_runs, "resumed"), run)
    with pytest.raises(LayoutMismatchError, match=r"saved with tp=2 dp=1 pp=1 .*resuming with tp=1 dp=1 pp=1.*"
                                                   r"resharding is not supported yet; fix: .*parallel.tp=2"):
        train(run)


def test_resume_off_starts_fresh(tmp_path):
    run = str(tmp_path)
    train(run, save_every=10, stop_after=10)
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer
    from train_cases import small_config

    cfg = small_config()
    cfg.train.resume = False
    assert Trainer(cfg, ParallelGrid.single(), run).resume() == 0


def test_config_rejects_negative_values():
    errors = check_train(TrainConfig(save_every=-1, keep_last=-3), dp=1)
    assert any("train.save_every=-1 must be >= 0" in e for e in errors)
    assert any("train.keep_last=-3 must be >= 0" in e for e in errors)
    assert check_train(TrainConfig(save_every=0, keep_last=0), dp=1) == []
