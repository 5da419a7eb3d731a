"""Issue 17, part 5: the holes found by using megaft as a user would, one test each.

1. the run-directory lock; 2. resuming another model; 3. train.max_bad_steps;
4. SIGTERM and Ctrl-C to a local run (megaft-train subprocess); 5. a leftover step_N.tmp.
"""
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch
from train_cases import read_rows, small_config

from megaft.checkpoint import CheckpointWarning, ModelMismatchError, io, list_checkpoints, problem
from megaft.launch import runlock
from megaft.launch.local import launch_local
from megaft.launch.rank import EXIT_STOPPED
from megaft.parallel.grid import ParallelGrid
from megaft.training.guards import BadStepsError
from megaft.training.loop import Trainer

SCRIPT = os.path.join(os.path.dirname(sys.executable), "megaft-train")


pytestmark = pytest.mark.usefixtures("not_in_slurm")  # tests/launch/conftest.py


def _write_lock(run_dir, pid, job=None, host=None):
    holder = {"host": host or socket.gethostname(), "pid": pid, "start": runlock._start_time(pid),
              "slurm_job_id": job, "time": time.time()}
    with open(os.path.join(run_dir, runlock.LOCK_FILE), "w") as f:
        json.dump(holder, f)


# --- 1. run-directory lock ------------------------------------------------------------------------

def test_lock_refuses_a_live_holder_and_takes_over_stale_or_own_job_locks(tmp_path):
    run = str(tmp_path)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        _write_lock(run, sleeper.pid)
        with pytest.raises(runlock.RunLockedError) as info:
            runlock.acquire(run, environ={})
        msg = str(info.value)
        assert f"run directory {run} is in use by another run (host {socket.gethostname()}, pid {sleeper.pid}, " \
               "since " in msg and "fix: wait for it to end, use another hydra.run.dir" in msg, msg
        # Held on another host: cannot be checked from here, so it counts as live.
        _write_lock(run, 1, host="elsewhere")
        with pytest.raises(runlock.RunLockedError, match="host elsewhere, pid 1"):
            runlock.acquire(run, environ={})
        # The requeued Slurm job finds the lock its earlier attempt took (the holder pid may even be alive).
        _write_lock(run, sleeper.pid, job="4242")
        with pytest.raises(runlock.RunLockedError, match="Slurm job 4242"):
            runlock.acquire(run, environ={"SLURM_JOB_ID": "77"})  # another job: refused
        with pytest.warns(runlock.StaleLockWarning, match="an earlier attempt of this Slurm job .requeued."):
            mine = runlock.acquire(run, environ={"SLURM_JOB_ID": "4242"})
        assert mine["pid"] == os.getpid() and mine["slurm_job_id"] == "4242"
        runlock.release(run, mine)
        assert not os.path.exists(os.path.join(run, runlock.LOCK_FILE))
    finally:
        sleeper.kill()
        sleeper.wait()
    # A dead holder on this host: stale, taken over with a warning.
    _write_lock(run, sleeper.pid)
    with pytest.warns(runlock.StaleLockWarning, match=f"pid {sleeper.pid}.*its process no longer exists .stale."):
        with runlock.run_lock(run):
            held = json.load(open(os.path.join(run, runlock.LOCK_FILE)))
            assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    assert not os.path.exists(os.path.join(run, runlock.LOCK_FILE))


def test_second_run_into_a_busy_dir_fails_before_any_rank_starts(tmp_path):
    """A live launcher (another process) holds the dir: launch_local fails at once and writes nothing."""
    run = str(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "from megaft.launch.runlock import run_lock\n"
                               f"import time\nwith run_lock({run!r}):\n    print('held', flush=True)\n"
                               "    time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = small_config()
        cfg.launcher.nproc = 1
        start = time.monotonic()
        with pytest.raises(runlock.RunLockedError, match=f"pid {holder.pid}"):
            launch_local(cfg, run)
        assert time.monotonic() - start < 5  # no rank was spawned
        assert sorted(os.listdir(run)) == [runlock.LOCK_FILE]  # no metrics.jsonl, no checkpoints
    finally:
        holder.kill()
        holder.wait()


# --- 2. resuming another model --------------------------------------------------------------------

def _trainer(run, cfg):
    os.makedirs(run, exist_ok=True)
    return Trainer(cfg, ParallelGrid.single(), run)


def test_resuming_another_model_is_refused_naming_both_values(tmp_path):
    run = str(tmp_path)
    cfg = small_config(steps=4)
    cfg.model.n_layers, cfg.train.save_every = 3, 2
    _trainer(run, cfg).fit(stop_after=2)
    manifest = io.read_manifest(io.step_dir(os.path.join(run, "checkpoints"), 2))
    assert manifest["model"]["n_layers"] == 3 and manifest["model"]["dim"] == 64
    changed = small_config(steps=4)
    changed.model.n_layers, changed.model.ffn_dim, changed.train.save_every = 2, 96, 2
    with pytest.raises(ModelMismatchError) as info:
        _trainer(run, changed).fit()
    msg = str(info.value)
    assert "holds another model than this run: model.ffn_dim: checkpoint 128, this run 96; model.n_layers: " \
           "checkpoint 3, this run 2. Only the parallel layout (tp, pp, dp, ZeRO) may change on resume" in msg, msg
    # A checkpoint written before models were recorded: a warning, and the resume goes on.
    path = io.step_dir(os.path.join(run, "checkpoints"), 2)
    del manifest["model"]
    with open(os.path.join(path, io.MANIFEST), "w") as f:
        json.dump(manifest, f)
    assert problem(path) is None  # the checksums cover the shards only
    with pytest.warns(CheckpointWarning, match="records no model config"):
        _trainer(run, cfg).fit()
    assert [r["step"] for r in read_rows(run) if "loss" in r] == [1, 2, 3, 4]


# --- 3. train.max_bad_steps -----------------------------------------------------------------------

def test_diverged_fp16_run_aborts_keeping_the_last_good_checkpoint(tmp_path):
    """The issue's case, precision=fp16 optim.lr=1e4: step 1 is finite, every later one NaN."""
    run = str(tmp_path)
    cfg = small_config(steps=30)
    cfg.precision, cfg.optim.lr = "fp16", 1e4
    cfg.train.save_every, cfg.train.keep_last, cfg.train.max_bad_steps = 1, 2, 3
    with pytest.raises(BadStepsError) as info:
        _trainer(run, cfg).fit()
    ckpts = os.path.join(run, "checkpoints")
    assert str(info.value).startswith(
        "training diverged: 3 consecutive steps (2..4) had a non-finite loss or grad norm (last: loss=nan "
        "grad_norm=nan loss_scale=8192 skipped_steps=3), train.max_bad_steps=3; the last good checkpoint is "
        f"{io.step_dir(ckpts, 1)} (none was written after a non-finite step); fix: lower optim.lr"), info.value
    assert [s for s, _ in list_checkpoints(ckpts)] == [1]  # steps 2..4 saved nothing, pruned nothing
    shard = torch.load(os.path.join(io.step_dir(ckpts, 1), "rank_00000.pt"), weights_only=False)
    assert all(torch.isfinite(p).all() for p in shard["params"])
    losses = [r["loss"] for r in read_rows(run) if "loss" in r]
    assert len(losses) == 4 and math.isfinite(losses[0]) and all(math.isnan(x) for x in losses[1:])


# --- 4. SIGINT/SIGTERM to a local run -------------------------------------------------------------

def _start(run, steps=400):
    assert os.path.exists(SCRIPT), f"{SCRIPT} missing: `make install` installs the console script"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    args = [f"hydra.run.dir={run}", "parallel.tp=2", "launcher.nproc=2", "model.dim=64", "model.n_layers=1",
            "data.seq_len=32", "data.task_train_size=200", "data.task_eval_size=16", f"train.max_steps={steps}",
            "train.progress=false", "launcher.max_requeue=0"]
    # Its own process group, as a terminal's foreground job has: Ctrl-C signals that whole group.
    return subprocess.Popen([SCRIPT, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _ranks_of(pid):
    """Pids of the launcher's ranks: its children started by multiprocessing's spawn (not its resource tracker)."""
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                spawned = "spawn_main" in f.read()
            if parent == pid and spawned:
                kids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return kids


def _wait_training(proc, run, lines=2):
    path = os.path.join(run, "metrics.jsonl")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read()[-3000:])
        if os.path.exists(path) and sum('"loss"' in ln for ln in open(path)) >= lines:
            return
        time.sleep(0.2)
    raise AssertionError("no training progress")


def _gone(pids, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if os.path.exists(f"/proc/{p}") and
                open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]:
            return True
        time.sleep(0.2)
    return False


def _saved_at_the_last_step(proc, run, ranks):
    """The run stopped after saving the step it was in: exit 75 (not finished: run again to resume), one
    complete checkpoint at the last train line, no summary (the run is not over), ranks gone, lock released."""
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED == 75, out[-3000:]
    assert "megaft: stopped by SIGTERM after saving a checkpoint; not requeued" in out, out[-3000:]
    assert "megaft-train: stopped by SIGTERM after saving a checkpoint, before train.max_steps; run again" in out
    saved = [s for s, _ in list_checkpoints(os.path.join(run, "checkpoints"))]
    train_steps = [r["step"] for r in read_rows(run) if "loss" in r]
    assert len(saved) == 1 and saved[0] == train_steps[-1] < 400, (saved, train_steps)
    assert problem(io.step_dir(os.path.join(run, "checkpoints"), saved[0])) is None
    assert not os.path.exists(os.path.join(run, "summary.json")) and _gone(ranks)
    assert not os.path.exists(os.path.join(run, runlock.LOCK_FILE))  # released


def test_sigterm_to_the_launcher_alone_is_forwarded_and_the_ranks_save(tmp_path):
    """`kill <launcher pid>` (a process manager, a job script's trap): the ranks, in their own process
    group, get nothing from the sender; the launcher forwards SIGTERM and they save at the next step."""
    run = str(tmp_path)
    proc = _start(run)
    _wait_training(proc, run)
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(proc.pid, signal.SIGTERM)
    _saved_at_the_last_step(proc, run, ranks)
    # running it again resumes from that checkpoint, finishes, and exits 0 with a summary (a few steps
    # past the checkpoint: train.max_steps may change on resume, and the 400 of the first run only keep it
    # training until the signal)
    last = [r["step"] for r in read_rows(run) if "loss" in r][-1]
    proc = _start(run, steps=last + 10)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    steps = [r["step"] for r in read_rows(run) if "loss" in r]
    assert steps == list(range(1, last + 11)) and os.path.exists(os.path.join(run, "summary.json"))


def test_ctrl_c_saves_at_the_next_step_and_a_second_one_kills(tmp_path):
    run = str(tmp_path / "a")
    proc = _start(run)
    _wait_training(proc, run)
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 2, ranks
    # While it trains, a second run into the same directory is refused, naming this one.
    cfg = small_config()
    with pytest.raises(runlock.RunLockedError, match=f"pid {proc.pid}"):
        launch_local(cfg, run)
    os.killpg(os.getpgid(proc.pid), signal.SIGINT)  # what Ctrl-C in its terminal does (whole group)
    _saved_at_the_last_step(proc, run, ranks)

    run = str(tmp_path / "b")  # ranks that cannot reach a step boundary: the second Ctrl-C kills them
    proc = _start(run)
    _wait_training(proc, run)
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)  # stuck (as in a hung collective): the first signal cannot stop them
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(1)  # two signals at once would merge into one
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "megaft-train: a second stop signal killed the 2 rank(s) without a " \
        "checkpoint" in out, out[-3000:]
    assert list_checkpoints(os.path.join(run, "checkpoints")) == []
    assert _gone(ranks), "a rank outlived the launcher"


# --- 5. a leftover step_N.tmp ---------------------------------------------------------------------

def test_leftover_tmp_checkpoint_is_removed_on_the_next_start(tmp_path):
    run = str(tmp_path)
    ckpts = os.path.join(run, "checkpoints")
    cfg = small_config(steps=4)
    cfg.train.save_every = 2
    _trainer(run, cfg).fit(stop_after=2)
    left = io.step_dir(ckpts, 4) + ".tmp"  # as a full disk during the save of step 4 would leave it
    os.makedirs(left)
    with open(os.path.join(left, "rank_00000.pt"), "wb") as f:
        f.write(b"\0" * 100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(run, cfg)
    assert not os.path.exists(left)
    assert [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)] == [
        f"removed {left}: an unfinished checkpoint left by an earlier save that failed or was killed (it was never "
        "used)"]
    trainer.fit()  # resumes from step 2 and saves step 4 for real
    assert [s for s, _ in list_checkpoints(ckpts)] == [2, 4] and sorted(os.listdir(ckpts)) == [
        "step_000002", "step_000004"]
