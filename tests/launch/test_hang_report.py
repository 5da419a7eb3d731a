"""Issue 17, part 3: a collective times out; the launcher's report names the rank behind,
its host and grid coordinates, and what the others were waiting in; nothing is left running."""
import json
import os
import socket
import time

import pytest
from train_cases import small_config

from launch.faults import FAULT_STEP, HANG_MARK, sigstop_worker
from megaft.launch import health
from megaft.launch.local import RankFailedError, launch_local
from megaft.launch.trace import CollectiveTrace, describe
from megaft.pipeline.actions import Action, ActionKind

TIMEOUT_S = 3  # launcher.timeout_s: small, so the test is fast


def config():
    cfg = small_config()
    cfg.parallel.tp = 2
    cfg.launcher.nproc, cfg.launcher.timeout_s, cfg.launcher.max_requeue = 2, TIMEOUT_S, 0
    return cfg


pytestmark = pytest.mark.usefixtures("not_in_slurm")  # tests/launch/conftest.py


def test_sigstopped_rank_is_named_with_host_and_coordinates(tmp_path):
    run = str(tmp_path)
    with pytest.raises(RankFailedError) as info:
        launch_local(config(), run, worker=sigstop_worker)  # tp=2 on 2 ranks
    took = time.time() - float(open(os.path.join(run, HANG_MARK)).read())  # since rank 1 stopped
    msg, host, step = str(info.value), socket.gethostname(), FAULT_STEP + 1
    report = msg[msg.index("megaft: hang report:"):]
    lines = report.splitlines()
    assert lines[0] == "megaft: hang report: rank(s) 1 behind", report
    assert lines[1].startswith(f"  rank 0 on {host} (pp=0 dp=0 cp=0 tp=0): step {step}, in #"), report
    assert lines[1].endswith(" waiting") and "all_reduce(group of 2" in lines[1], report  # a tp all-reduce
    assert lines[2] == f"  rank 1 on {host} (pp=0 dp=0 cp=0 tp=1): no report (hung outside a collective, or dead)"
    # within launcher.timeout_s in the collective + at most timeout_s waiting for markers (+ CI slack)
    assert took < 2 * TIMEOUT_S + 15, took
    for rank in (0, 1):  # no rank left behind (the stopped one was SIGKILLed)
        pid = json.load(open(os.path.join(run, health.HEALTH_DIR, f"who_{rank:05d}.json")))["pid"]
        assert not os.path.exists(f"/proc/{pid}"), f"rank {rank} (pid {pid}) is still there"


def test_trace_numbers_collectives_and_marks_the_one_waited_in():
    trace = CollectiveTrace(keep=2)
    entries = [{"seq": 7, "op": "all_reduce", "group_size": 2, "numel": 3, "state": "waiting"},
               {"seq": 8, "op": "barrier", "group_size": None, "numel": None, "state": "done"}]
    assert describe(entries[0]) == "#7 all_reduce(group of 2, 3 elements) waiting"
    assert describe(entries[1]) == "#8 barrier() done"
    trace.step_of = lambda: 12
    assert trace.snapshot() == {"step": 12, "action": None, "collectives": [], "seq": 0}
    trace.action_of = lambda: Action(1, ActionKind.F, 3)  # PipelineRuntime.current_action
    assert trace.snapshot()["action"] == "1F3"
    trace.action_of = lambda: [Action(0, ActionKind.SEND_F, 2), Action(0, ActionKind.RECV_B, 1)]
    assert trace.snapshot()["action"] == "[0SEND_F2, 0RECV_B1]"


def test_report_names_the_pipeline_action_a_rank_waited_in(tmp_path):
    """pp=2: rank 1 (stage 1) waits for micro-batch 2's activations in its forward; rank 0 never reports."""
    run, t0 = str(tmp_path), time.time()
    for rank in (0, 1):
        health.announce(run, rank, {"pp": rank, "dp": 0, "cp": 0, "tp": 0})
    exc = RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    waiting = {"step": 3, "action": "1F2", "seq": 9, "collectives": [
        {"seq": 9, "op": "batch_isend_irecv", "group_size": 2, "numel": 1024, "state": "async", "time": t0}]}
    health.diagnose(exc, run, 1, 2, 5, wait_s=0, waiting=waiting)
    host = socket.gethostname()
    assert health.hang_report(run, 2, since=t0 - 1).splitlines() == [
        "megaft: hang report: rank(s) 0 behind",
        f"  rank 0 on {host} (pp=0 dp=0 cp=0 tp=0): no report (hung outside a collective, or dead)",
        f"  rank 1 on {host} (pp=1 dp=0 cp=0 tp=0): step 3, pipeline action 1F2, in #9 "
        "batch_isend_irecv(group of 2, 1024 elements) async"]


def test_report_names_a_rank_that_entered_the_collective_late(tmp_path):
    """A frozen rank that Slurm's SIGCONT resumes reports too, but it entered the collective only
    after its peer had already failed on it: that rank is the one behind."""
    run, t0 = str(tmp_path), time.time()
    for rank in (0, 1):
        health.announce(run, rank, {"pp": 0, "dp": 0, "cp": 0, "tp": rank})
    exc = RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")

    def waiting(entered):
        return {"step": 7, "seq": 40, "collectives": [
            {"seq": 40, "op": "all_reduce", "group_size": 2, "numel": 4, "state": "waiting", "time": entered}]}

    health.diagnose(exc, run, 0, 2, 5, wait_s=0, waiting=waiting(t0))
    time.sleep(0.05)
    health.diagnose(exc, run, 1, 2, 5, wait_s=0, waiting=waiting(time.time()))  # resumed, then failed
    host = socket.gethostname()
    assert health.hang_report(run, 2, since=t0 - 1).splitlines() == [
        "megaft: hang report: rank(s) 1 behind",
        f"  rank 0 on {host} (pp=0 dp=0 cp=0 tp=0): step 7, in #40 all_reduce(group of 2, 4 elements) waiting",
        f"  rank 1 on {host} (pp=0 dp=0 cp=0 tp=1): step 7, in #40 all_reduce(group of 2, 4 elements) waiting, "
        "entered after another rank had failed on it (late)"]


def test_hang_report_names_the_pipeline_action(tmp_path):
    """Under pp the waiting rank's line says which schedule action it was in (megaft.pipeline.runtime)."""
    cfg = config()
    cfg.parallel.tp, cfg.parallel.pp = 1, 2
    with pytest.raises(RankFailedError) as info:
        launch_local(cfg, str(tmp_path), worker=sigstop_worker)  # stage 1 (rank 1) frozen
    msg = str(info.value)
    report = msg[msg.index("megaft: hang report:"):]
    lines = report.splitlines()
    assert lines[0] == "megaft: hang report: rank(s) 1 behind", report
    assert lines[1].startswith(f"  rank 0 on {socket.gethostname()} (pp=0 dp=0 cp=0 tp=0): step {FAULT_STEP + 1}, "
                               "pipeline action 0"), report


def test_other_ranks_hold_their_exit_until_rank_0_has_reported(tmp_path, monkeypatch):
    """Under `srun --kill-on-bad-exit` the first rank out gets the others killed: a survivor other
    than rank 0 waits for rank 0's report (plus a grace to print it), and no longer than its wait
    when rank 0 is the one behind."""
    monkeypatch.setattr(health, "REPORT_GRACE_S", 0.5)
    exc = RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    run = str(tmp_path / "silent0")
    start = time.monotonic()
    health.diagnose(exc, run, 1, 2, 5, wait_s=0.6)  # rank 0 never reports: only the wait
    assert 0.6 <= time.monotonic() - start < 0.6 + 0.5 + 1.0
    run = str(tmp_path / "reported")
    for rank in (0, 1):
        health.announce(run, rank, {"pp": 0, "dp": 0, "cp": 0, "tp": rank})
    health.diagnose(exc, run, 0, 2, 5, wait_s=0)
    start = time.monotonic()
    health.diagnose(exc, run, 1, 2, 5, wait_s=3)  # rank 0's marker is there: no marker wait, only the grace
    assert 0.5 <= time.monotonic() - start < 2.0
