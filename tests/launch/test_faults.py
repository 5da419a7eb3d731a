"""The local launcher under faults: a preemption signal to one rank, a hung rank, a dead rank.

Each case is one real `launch_local` of 2 gloo ranks at tp=2 (small_config, 20 steps)
with rank 1 patched by a worker from tests/launch/faults.py.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from checkpoint_cases import assert_same_losses
from train_cases import read_rows, small_config

from launch.faults import FAULT_STEP, HANG_MARK, die_worker, hang_worker, signal_worker
from megaft.checkpoint import io, list_checkpoints, problem
from megaft.launch.local import RankFailedError, launch_local
from megaft.launch.rank import RunStoppedError

TIMEOUT_S = 3  # launcher.timeout_s of the hang/death cases: small, so the test is fast


def config(timeout_s=60):
    cfg = small_config()
    cfg.parallel.tp = 2
    cfg.launcher.nproc, cfg.launcher.timeout_s = 2, timeout_s
    cfg.launcher.max_requeue = 0  # never `scontrol requeue` from a test, even inside a Slurm job
    return cfg


pytestmark = pytest.mark.usefixtures("not_in_slurm")  # tests/launch/conftest.py


def test_signal_to_one_rank_stops_all_at_one_step_then_resumes_exactly(straight, tmp_path, capfd):
    run = str(tmp_path)
    with pytest.raises(RunStoppedError, match="run again in the same directory to resume"):
        launch_local(config(), run, worker=signal_worker)  # saved and stopped: not finished (exit 75)
    stopped = FAULT_STEP + 1  # the signal lands during step FAULT_STEP; every rank stops after it
    ckpts = os.path.join(run, "checkpoints")
    assert [s for s, _ in list_checkpoints(ckpts)] == [stopped]  # saved although train.save_every=0
    assert problem(io.step_dir(ckpts, stopped)) is None
    manifest = io.read_manifest(io.step_dir(ckpts, stopped))
    assert sorted(manifest["files"]) == ["rank_00000.pt", "rank_00001.pt"]  # both ranks saved the same step
    assert [r["step"] for r in read_rows(run) if "loss" in r] == list(range(1, stopped + 1))  # rank 0 stopped too
    assert not os.path.exists(os.path.join(run, "summary.json"))  # not finished
    out = capfd.readouterr().out
    assert "stopped by a signal and saved a checkpoint; not a Slurm job, so not requeued" in out, out[-2000:]

    launch_local(config(), run)  # the requeued job
    assert_same_losses(run, straight)
    assert json.load(open(os.path.join(run, "summary.json")))["steps"] == 20


def _failure(worker, run):
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch_local(config(TIMEOUT_S), run, worker=worker)
    with open(os.path.join(run, HANG_MARK)) as f:
        fault_at = float(f.read())
    return str(info.value), time.time() - fault_at, time.monotonic() - start


def test_hung_rank_fails_the_others_within_the_timeout_naming_it(tmp_path):
    msg, since_fault, _ = _failure(hang_worker, str(tmp_path))
    # Rank 0 times out in its next collective and names rank 1, which never reported the failure.
    assert msg.startswith("rank 0 of 2 exited with code 1"), msg
    assert "suspected rank(s) 1:" in msg and "launcher.timeout_s=3" in msg, msg
    # Bound: timeout_s in the collective + at most timeout_s waiting for markers, plus slack for CI.
    assert since_fault < 2 * TIMEOUT_S + 15, since_fault


def test_dead_rank_is_named_and_the_others_stopped(tmp_path):
    msg, since_fault, _ = _failure(die_worker, str(tmp_path))
    assert msg.startswith("rank 1 of 2 was killed by SIGKILL; the other ranks were stopped"), msg
    assert since_fault < 10, since_fault


def test_a_signal_during_the_imports_is_kept_until_the_handlers_exist(tmp_path):
    """`megaft-train` gets USR1 0.3 s after it starts, long before torch is imported: blocked from
    the first line (megaft/cli.py) it stays pending, the launcher forwards it, and the ranks stop
    at their first step boundary with a checkpoint instead of dying of the signal (exit -10)."""
    script = os.path.join(os.path.dirname(sys.executable), "megaft-train")
    assert os.path.exists(script), f"{script} missing: `make install` installs the console script"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    args = [f"hydra.run.dir={tmp_path}", "parallel.tp=2", "launcher.nproc=2", "model.dim=64", "model.n_layers=1",
            "data.seq_len=32", "data.task_train_size=200", "data.task_eval_size=16", "train.max_steps=50",
            "train.progress=false", "launcher.max_requeue=0"]
    proc = subprocess.Popen([script, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]  # saved but not finished (megaft.launch.rank.EXIT_STOPPED)
    assert "stopped by a signal and saved a checkpoint; not a Slurm job, so not requeued" in out, out[-3000:]
    assert [s for s, _ in list_checkpoints(os.path.join(tmp_path, "checkpoints"))] == [1], out[-3000:]
