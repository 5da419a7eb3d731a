"""The real-Slurm tests (tests/slurm) run in a second pytest process beside the rest of the suite.

They spend about a third of their ~10 minutes waiting on Slurm (scheduling, a requeued job's
credential hold, a time limit's signal) while the rest of the suite keeps one core of two
busy most of the time (the pytest process is one torch thread): side by side the two use
the idle core, and the session takes ~4 minutes less than one after the other (measured:
tests/slurm beside the multi-rank files, 713 s against 592 s + 389 s; docs/contributing.md).

How: once the session's tests are chosen, the tests/slurm ones are moved to the end and a
background `python -m pytest <their ids>` starts at once; it writes each test's reports
(pytest's own report serialization, as pytest-xdist uses) to a file. When this session
reaches those tests it replays their reports instead of running them, waiting for each:
the same ids, counts, outcomes, failure texts, captured output and durations. A test the
background run left without a report (it crashed, was killed) fails with its output's tail.

Only when the session holds both kinds of test (`pytest tests/slurm` runs as usual), and
not with MEGAFT_SLURM_STREAM=0 (everything in this process, in collection order).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

OUT = "MEGAFT_SLURM_STREAM_OUT"  # set in the background run: the file its reports go to
SLURM_DIR = os.path.join("tests", "slurm") + os.sep


def is_slurm(item) -> bool:
    return item.nodeid.replace("/", os.sep).startswith(SLURM_DIR)


class Recorder:
    """In the background run: every test report, serialized, one JSON line each, as it comes."""

    def __init__(self, config, path: str):
        self.config, self.file = config, open(path, "a", buffering=1)

    def pytest_runtest_logreport(self, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.file.write(json.dumps(data) + "\n")

    def pytest_unconfigure(self):
        self.file.close()


class Stream:
    """In the main session: start the background run of the Slurm tests, replay their reports."""

    def __init__(self, config):
        self.config, self.ids, self.proc, self.reports, self.offset = config, set(), None, {}, 0

    @pytest.hookimpl(trylast=True)  # after -k/-m/--lf have chosen the tests
    def pytest_collection_modifyitems(self, session, config, items):
        slurm = [item for item in items if is_slurm(item)]
        if slurm and len(slurm) < len(items) and not config.option.collectonly:
            items[:] = [item for item in items if not is_slurm(item)] + slurm
            self.ids = {item.nodeid for item in slurm}
            self._start([item.nodeid for item in slurm])

    def _start(self, ids: list[str]) -> None:
        base = self.config._tmp_path_factory.getbasetemp() / "slurm-stream"
        base.mkdir()
        self.out, self.log = base / "reports.jsonl", base / "output.log"
        self.out.touch()
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={base / 'tmp'}",
                f"--capture={self.config.option.capture}", *ids]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, cwd=self.config.rootpath, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, **{OUT: str(self.out)}))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if item.nodeid not in self.ids:
            return None
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in self._wait(item):
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _wait(self, item) -> list:
        """The test's reports (setup, call, teardown) once its teardown's is in; a failed one made
        here when the background run ended without it."""
        while not self._done(item.nodeid):
            if self.proc.poll() is not None and not self._read():
                return self.reports.pop(item.nodeid, []) + [self._lost(item)]
            time.sleep(0.2)
        return self.reports.pop(item.nodeid)

    def _done(self, nodeid: str) -> bool:
        self._read()
        return any(r.when == "teardown" for r in self.reports.get(nodeid, []))

    def _read(self) -> bool:
        """Take in the complete lines written since the last read; whether there were any."""
        with open(self.out) as f:
            f.seek(self.offset)
            text = f.read()
        text = text[:text.rfind("\n") + 1]
        self.offset += len(text.encode())
        for line in text.splitlines():
            data = json.loads(line)  # JSON made the tuples lists: a skip's longrepr and location are tuples
            data["location"] = tuple(data["location"])
            if isinstance(data.get("longrepr"), list):
                data["longrepr"] = tuple(data["longrepr"])
            report = self.config.hook.pytest_report_from_serializable(config=self.config, data=data)
            self.reports.setdefault(report.nodeid, []).append(report)
        return bool(text)

    def _lost(self, item):
        with open(self.log, errors="replace") as f:
            tail = f.read()[-4000:]
        return pytest.TestReport(item.nodeid, item.location, {}, "failed",
                                 f"the background run of the Slurm tests (tests/slurm_stream.py) ended with exit "
                                 f"code {self.proc.returncode} and no result for this test; its output ends:\n{tail}",
                                 "call")

    def pytest_unconfigure(self):
        if self.proc is not None and self.proc.poll() is None:  # interrupted: nothing is left running
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def configure(config) -> None:
    """Register the recorder (in the background run) or the stream (in a main session)."""
    if os.environ.get(OUT):
        config.pluginmanager.register(Recorder(config, os.environ[OUT]), "megaft-slurm-recorder")
    elif os.environ.get("MEGAFT_SLURM_STREAM", "1") != "0":
        config.pluginmanager.register(Stream(config), "megaft-slurm-stream")
