"""Checkpoints: atomic publish, manifest checks, keep_last, exact (bitwise) resume, fallback."""
import os
import shutil

import pytest
import torch
from checkpoint_cases import (
    RESUMED_SINGLE,
    RESUMED_WORLD2,
    assert_same_losses,
    resume_resharded,
    run_layout,
    save_and_reshard_zero,
    tp2_straight_and_resumed,
    train,
)
from multirank import spawn
from train_cases import read_metrics, read_rows

from megaft.checkpoint import (
    CheckpointWarning,
    CheckpointWriter,
    LayoutMismatchError,
    find_latest,
    io,
    list_checkpoints,
    problem,
)
from megaft.config.train import TrainConfig, check_train
from megaft.parallel.grid import ParallelGrid

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)


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


assert_same_curve = assert_same_losses


def load_shard(run_dir, step, rank=0):
    path = os.path.join(io.step_dir(os.path.join(run_dir, "checkpoints"), step), io.shard_name(rank))
    return torch.load(path, weights_only=False)


def assert_same_shard(a, b):
    """Two shards hold the same step, tensors and RNG states (async must save what sync saves)."""
    assert a.keys() == b.keys()
    for key in a:
        try:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)  # bitwise, nested lists/dicts too
        except TypeError:  # not tensors or numbers: plain equality
            assert a[key] == b[key], key


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


def test_tp2_async_save_equals_sync_and_resumes_exactly(tp2_runs):
    resumed_async = os.path.join(tp2_runs, "resumed_async")
    assert_same_curve(resumed_async, os.path.join(tp2_runs, "straight"))
    assert steps(resumed_async) == [10, 20]
    for step in (10, 20):
        assert problem(io.step_dir(os.path.join(resumed_async, "checkpoints"), step)) is None
        for rank in (0, 1):
            assert_same_shard(load_shard(resumed_async, step, rank), load_shard(os.path.join(tp2_runs, "resumed"),
                                                                                step, rank))


def test_async_save_writes_what_sync_writes_and_resumes_exactly(straight, tmp_path):
    sync, async_ = str(tmp_path / "sync"), str(tmp_path / "async")
    train(sync, save_every=5, keep_last=0)
    train(async_, save_every=5, keep_last=0, async_save=True)
    assert steps(async_) == steps(sync) == [5, 10, 15, 20]  # the run's end published the last one
    assert not [n for n in os.listdir(os.path.join(async_, "checkpoints")) if n.endswith(".tmp")]
    for step in (5, 10, 15, 20):
        assert problem(io.step_dir(os.path.join(async_, "checkpoints"), step)) is None
        assert_same_shard(load_shard(async_, step), load_shard(sync, step))
    resumed = str(tmp_path / "resumed")
    train(resumed, save_every=5, async_save=True, stop_after=10)  # stops with a save in flight: published
    assert steps(resumed) == [5, 10]
    train(resumed, save_every=5, async_save=True)
    assert_same_curve(resumed, straight)


def test_async_writer_publishes_only_once_every_shard_is_written(tmp_path):
    root = str(tmp_path)
    writer = CheckpointWriter(root, ParallelGrid.single(), keep_last=0, async_save=True)
    live = torch.arange(4.0)
    writer.save(3, {"step": 3, "params": [live]})
    live.add_(100.0)  # training goes on: the saved copy must not see it
    assert list_checkpoints(root) == []  # in flight: only step_000003.tmp/ exists
    writer.pending.thread.join()
    assert writer.unfinished() == 0  # this rank's vote at the next step boundary
    writer.all_written()  # every rank voted 0: rank 0 publishes
    assert steps_of(root) == [3] and problem(io.step_dir(root, 3)) is None
    assert torch.equal(torch.load(os.path.join(io.step_dir(root, 3), "rank_00000.pt"))["params"][0],
                       torch.arange(4.0))
    writer.save(4, {"step": 4})
    writer.finish()  # the end of a run: wait and publish
    assert steps_of(root) == [3, 4]


def steps_of(root):
    return [s for s, _ in list_checkpoints(root)]


def copy_at_step_10(tp2_runs, run):
    shutil.copytree(os.path.join(tp2_runs, "resumed"), run)
    shutil.rmtree(os.path.join(run, "checkpoints", "step_000020"))  # resume from step 10 (metrics get trimmed)
    os.remove(os.path.join(run, "summary.json"))
    return run


def assert_continues(run, tp2_runs):
    """Another layout reorders the sums: the curve matches within fp32 noise (measured ~1e-7), not bitwise."""
    got, _ = read_metrics(run)
    want, _ = read_metrics(os.path.join(tp2_runs, "straight"))
    assert len(got) == len(want) == 20
    assert got[:10] == want[:10]  # the saved run's own lines
    torch.testing.assert_close(got[10:], want[10:], rtol=1e-6, atol=1e-7)


def test_tp2_checkpoint_resumes_resharded_at_tp1_pp2_dp2_and_zero1(tp2_runs, tmp_path):
    run = copy_at_step_10(tp2_runs, str(tmp_path / "tp1"))
    train(run)  # tp=1, one process
    assert_continues(run, tp2_runs)
    for name in ("pp2", "dp2", "zero1"):
        copy_at_step_10(tp2_runs, str(tmp_path / name))
    spawn(2, resume_resharded, str(tmp_path))
    for name in ("pp2", "dp2", "zero1"):
        assert_continues(str(tmp_path / name), tp2_runs)
    manifest = io.read_manifest(io.step_dir(os.path.join(tmp_path, "pp2", "checkpoints"), 20))
    assert manifest["layout"] == {"tp": 1, "dp": 1, "pp": 2, "world_size": 2}  # saved in the new layout


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero"))
    spawn(2, save_and_reshard_zero, root)
    for name, (_, *spec) in RESUMED_SINGLE.items():
        run_layout(os.path.join(root, name), *spec)
    return root


def assert_continues_straight(run, straight):
    """Resumed in another layout: the whole curve (saved part too, since the saved layout reorders
    sums as well) matches the single-process run within fp32 noise, not bitwise."""
    got, _ = read_metrics(run)
    want, _ = read_metrics(straight)
    assert len(got) == len(want) == 20
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted({**RESUMED_WORLD2, **RESUMED_SINGLE}))
def test_zero_and_pp_checkpoints_reshard(zero_runs, straight, name):
    run = os.path.join(zero_runs, name)
    assert_continues_straight(run, straight)
    src, tp, pp, dp, zero, _ = {**RESUMED_WORLD2, **RESUMED_SINGLE}[name]
    saved, _ = read_metrics(os.path.join(zero_runs, src))
    got, _ = read_metrics(run)
    assert got[:10] == saved  # the saved run's own lines are kept as they were
    manifest = io.read_manifest(io.step_dir(os.path.join(run, "checkpoints"), 20))
    assert manifest["layout"] == {"tp": tp, "dp": dp, "pp": pp, "world_size": tp * dp * pp}  # saved anew
    shard = load_shard(run, 20)
    assert shard["zero"] == zero and shard["step_count"] == 20


def test_zero2_same_layout_resume_is_bitwise_exact(zero_runs):
    assert_same_curve(os.path.join(zero_runs, "z2_same"), os.path.join(zero_runs, "z2_straight"))


def test_zero_shards_record_their_moment_ranges(zero_runs):
    """ZeRO-2 at dp=2: the two ranks' ranges tile every buffer (each element's moments saved once)."""
    a, b = (load_shard(os.path.join(zero_runs, "z2"), 10, r) for r in (0, 1))
    for g, params in enumerate(a["params"]):
        covered = torch.zeros(params.numel(), dtype=torch.int64)
        for shard in (a, b):
            assert sum(hi - lo for lo, hi, _ in shard["moments"][g]) == shard["exp_avg"][g].numel()
            for lo, hi, _ in shard["moments"][g]:
                covered[lo:hi] += 1
        assert covered.eq(1).all()
    assert max(len(r) for r in a["moments"]) > 1  # many buckets: scattered chunks, not one range


def test_layout_mismatch_without_reshard_is_a_clear_error(tp2_runs, tmp_path):
    from train_cases import small_config

    from megaft.checkpoint import load_latest
    from megaft.training.loop import Trainer

    run = copy_at_step_10(tp2_runs, str(tmp_path / "run"))
    trainer = Trainer(small_config(), ParallelGrid.single(), run)
    optim = trainer.parts.optim
    with pytest.raises(LayoutMismatchError, match=r"saved with tp=2 cp=1 dp=1 pp=1 .*"
                                                   r"resuming with tp=1 cp=1 dp=1 pp=1.*"
                                                   r"resharding needs the model.*; fix: .*parallel.tp=2"):
        load_latest(os.path.join(run, "checkpoints"), optim.flat, optim.optimizer, trainer.grid)


def test_resume_off_starts_fresh(tmp_path):
    run = str(tmp_path)
    train(run, save_every=10, stop_after=10)
    from train_cases import small_config

    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer

    cfg = small_config()
    cfg.train.resume = False
    assert Trainer(cfg, ParallelGrid.single(), run).resume() == 0


def test_config_rejects_negative_values():
    errors = check_train(TrainConfig(save_every=-1, keep_last=-3), dp=1)
    assert any("train.save_every=-1 must be >= 0" in e for e in errors)
    assert any("train.keep_last=-3 must be >= 0" in e for e in errors)
    assert check_train(TrainConfig(save_every=0, keep_last=0), dp=1) == []


def test_a_signal_after_the_last_step_finishes_the_run(tmp_path):
    """The time limit's warning may come after the last step: the run is done (summary, no requeue)."""
    from train_cases import small_config

    from megaft.training.loop import Trainer
    from megaft.training.stop import REQUEUE, PreemptFlag

    flag = PreemptFlag()
    trainer = Trainer(small_config(steps=3), ParallelGrid.single(), str(tmp_path))
    train_step = trainer.train_step

    def step_then_signal(step):
        out = train_step(step)
        if step == 2:  # the last of 3 (0-based)
            flag.value = REQUEUE
        return out

    trainer.train_step = step_then_signal
    summary = trainer.fit(flag=flag)
    assert "requeue" not in summary and "stopped_by" not in summary and summary["steps"] == 3
    assert os.path.isfile(os.path.join(tmp_path, "summary.json"))


def test_another_model_at_the_same_layout_is_a_clear_error(tmp_path):
    from train_cases import small_config

    from megaft.checkpoint import load_latest
    from megaft.training.loop import Trainer

    run = str(tmp_path)
    train(run, save_every=2, stop_after=2)
    cfg = small_config()
    cfg.model.ffn_dim = 96  # same layout (tp=dp=pp=1), another model: the buffers do not fit
    trainer = Trainer(cfg, ParallelGrid.single(), run)
    optim = trainer.parts.optim
    with pytest.raises(ValueError, match=r"cannot be resharded into this run's parallel.zero=0: parameter layers\."
                                         r"1\.mlp\.down_proj\.weight: checkpoint holds \(64, 128\), this model "
                                         r"\(64, 96\); fix: .*model config"):
        load_latest(os.path.join(run, "checkpoints"), optim.flat, optim.optimizer, trainer.grid,
                    model=trainer.parts.model)
