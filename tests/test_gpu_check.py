"""`make gpu-check` (benchmarks/gpu_check.py) on a machine without a GPU: the skip path, and
the runner's budgets and results file with real subprocess steps."""
from __future__ import annotations

import datetime
import json
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import Step, results_path, run_steps, summary_table, write_results

PY = sys.executable


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without a GPU")
def test_without_a_gpu_it_exits_0_with_one_line():
    out = subprocess.run([PY, "-m", "benchmarks.gpu_check"], cwd=gpu_check.ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("gpu-check: no CUDA GPU here (")
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout


def test_every_step_runs_within_its_budget_and_the_whole(tmp_path):
    write = "import json; json.dump({'rows': [1, 2]}, open(r'{out}/bench.json', 'w')); print('MFU 41.0%')"
    plan = [Step("fine", [PY, "-c", write], 30, json_out="bench.json"),
            Step("broken", [PY, "-c", "import sys; print('boom'); sys.exit(3)"], 30),
            Step("slow", [PY, "-c", "import time; print('started', flush=True); time.sleep(30)"], 1.5),
            Step("pytest_gpu", [PY, "-c", "print('== 5 passed, 2 skipped in 1.0s ==')"], 30)]
    rows = run_steps(plan, budget_s=60, out=str(tmp_path / "run"))
    by = {r["name"]: r for r in rows}
    assert by["fine"]["status"] == "ok" and by["fine"]["json"] == {"rows": [1, 2]}
    assert by["broken"]["status"] == "failed" and by["broken"]["rc"] == 3 and "boom" in by["broken"]["tail"]
    assert by["slow"]["status"] == "timeout" and by["slow"]["seconds"] < 10 and "stopped after" in by["slow"]["tail"]
    assert "started" in by["slow"]["tail"]  # what it printed before it was stopped is kept
    assert by["pytest_gpu"]["status"] == "ok"
    table = summary_table(rows).splitlines()  # each step's headline: what it measured
    assert table[1].endswith("MFU 41.0%") and table[4].endswith("5 passed, 2 skipped"), table


def test_the_whole_budget_skips_what_no_longer_fits(tmp_path):
    plan = [Step("first", [PY, "-c", "import time; time.sleep(3)"], 10), Step("second", [PY, "-c", "pass"], 10)]
    rows = run_steps(plan, budget_s=2, out=str(tmp_path))
    assert [r["status"] for r in rows] == ["timeout", "skipped"]
    assert rows[0]["seconds"] < 8  # stopped at what was left of the whole budget, not its own 10 s


def test_results_file_names_the_date_and_gpu_and_holds_every_step(tmp_path):
    path = results_path(str(tmp_path), "NVIDIA H100 80GB HBM3", datetime.date(2026, 11, 26))
    assert path.endswith("/2026-11-26-nvidia-h100-80gb-hbm3.json")
    rows = [{"name": "build", "status": "ok", "seconds": 1.0, "tail": "", "cmd": "x", "budget_s": 5}]
    write_results(path, "NVIDIA H100 80GB HBM3", rows, 480)
    doc = json.load(open(path))
    assert doc["schema"] == 1 and doc["gpu"] == "NVIDIA H100 80GB HBM3" and doc["steps"] == rows
    assert doc["command"] == "make gpu-check" and doc["versions"]["torch"] == torch.__version__


def test_the_plan_fits_eight_minutes_on_one_h100():
    plan = gpu_check.steps("9.0")
    assert sum(s.budget_s for s in plan) <= 480
    assert [s.name for s in plan] == ["wheels", "build", "pytest_gpu", "kernels", "adamw", "newton_schulz",
                                      "train_step_1b", "memory"]
    build = next(s for s in plan if s.name == "build")
    assert build.env["TORCH_CUDA_ARCH_LIST"] == "9.0" and build.env["MEGAFT_BUILD_CUDA"] == "1"
