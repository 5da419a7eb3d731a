"""Preemption flag, requeue decisions, failure diagnosis and launcher config checks (no ranks spawned).

The multi-process behaviour (one collective stops every rank at the same step; dead and
hung ranks) is in test_faults.py; the real Slurm requeue in tests/slurm/test_requeue.py.
"""
import os
import signal
import subprocess
import sys
import time

from megaft.config.launcher import LauncherConfig, check_launcher
from megaft.launch import health
from megaft.launch.preempt import requeue
from megaft.training.stop import NONE, REQUEUE, STOP, PreemptFlag, StepBoundary


def test_flag_records_the_strongest_signal_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptFlag() as flag:
        assert flag.value == NONE
        os.kill(os.getpid(), signal.SIGTERM)
        assert (flag.value, flag.signal_name) == (STOP, "SIGTERM")
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (flag.value, flag.signal_name) == (REQUEUE, "SIGUSR1")
        assert StepBoundary(1, "cpu").agree(flag.value, 0) == (REQUEUE, 0)  # world of one: no collective
    assert signal.getsignal(signal.SIGUSR1) is before
    with PreemptFlag() as flag:
        os.kill(os.getpid(), signal.SIGUSR2)  # submitit's time-limit signal
        assert (flag.value, flag.signal_name) == (REQUEUE, "SIGUSR2")


def test_second_sigterm_kills():
    code = ("import os, signal, time; from megaft.training.stop import PreemptFlag\n"
            "f = PreemptFlag().install(); os.kill(os.getpid(), signal.SIGTERM); assert f.value == 1\n"
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('survived')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGTERM and "survived" not in out.stdout, out


class FakeScontrol:
    def __init__(self, returncode=0):
        self.calls, self.returncode = [], returncode

    def __call__(self, args, **_):
        self.calls.append(args)
        return subprocess.CompletedProcess(args, self.returncode, "", "slurm_requeue error: Invalid job id")


def test_requeue_counts_restarts_against_max_requeue():
    run = FakeScontrol()
    msg = requeue(3, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, run=run)
    assert run.calls == [["scontrol", "requeue", "77"]]
    assert "requeued Slurm job 77 (restart 2 of at most 3)" in msg
    run = FakeScontrol()
    msg = requeue(3, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "3"}, run=run)
    assert run.calls == [] and "already requeued 3 time(s) (launcher.max_requeue=3), so it is NOT requeued" in msg
    msg = requeue(0, {"SLURM_JOB_ID": "78"}, run=run)  # max_requeue=0: never
    assert run.calls == [] and "NOT requeued" in msg
    msg = requeue(3, {}, run=run)
    assert run.calls == [] and "not a Slurm job, so not requeued" in msg
    msg = requeue(3, {"SLURM_JOB_ID": "79"}, run=FakeScontrol(returncode=1))
    assert "`scontrol requeue 79` failed (1: slurm_requeue error: Invalid job id)" in msg


def test_diagnose_names_the_rank_that_never_reported(tmp_path):
    run = str(tmp_path)
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")
    assert health.is_comm_failure(timeout) and not health.is_comm_failure(ValueError("bad shape"))
    assert health.is_comm_failure(RuntimeError("Application timeout caused pair closure"))  # gloo, seen on 2 nodes
    # Rank 2 reported its own failure earlier; rank 1 never does.
    os.makedirs(os.path.join(run, health.HEALTH_DIR))
    health.diagnose(timeout, run, rank=2, world=3, timeout_s=5, wait_s=0)
    start = time.monotonic()
    err = health.diagnose(timeout, run, rank=0, world=3, timeout_s=5, wait_s=0.5)
    assert time.monotonic() - start < 3  # waits at most wait_s for the silent rank
    assert str(err).startswith("rank 0 of 3: a collective failed (RuntimeError: [gloo")
    assert "suspected rank(s) 1: they did not report this failure within 0.5s" in str(err)
    health.report_crash(ValueError("bad shape"), run, rank=1)  # now rank 1 failed by itself
    err = health.diagnose(timeout, run, rank=0, world=3, timeout_s=5, wait_s=0.5)
    assert "rank 1 failed with ValueError: bad shape" in str(err)


def test_launcher_config_checks():
    assert check_launcher(LauncherConfig()) == []
    problems = check_launcher(LauncherConfig(timeout_s=0, max_requeue=-1))
    assert any("launcher.timeout_s=0 must be >= 1" in p for p in problems)
    assert any("launcher.max_requeue=-1 must be >= 0" in p and "fix:" in p for p in problems)
