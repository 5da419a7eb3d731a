"""GRPO with its rollouts generated at the training layout, as a Slurm sweep on the real
single-host Slurm (no Ray, no separate inference server): a 2-point sweep over rl.loss_type, each
point one job of 2 ranks (dp=2, each generating its prompts' groups, gathered over dp), finishes,
logs its rollouts and rewards, and both points sample the same first step (the draws are seeded by
the step and the prompt, and both start from the same weights)."""
import json
import os
import subprocess
import sys
import time

import pytest

from .conftest import ROOT
from .test_slurm import job_fields
from .test_sweep import TRAIN, queued

sys.path.insert(0, os.path.join(ROOT, "tests"))
from models.hf_fixture import make_hf_llama  # noqa: E402
from rl.grpo_cases import write_prompts  # noqa: E402

REWARD = '''def letters(completions, answer, **kwargs):
    return [float(sum(ch in a for ch in c)) for c, a in zip(completions, answer)]
'''


def test_an_online_grpo_sweep_runs_as_slurm_jobs(slurm_cluster, tmp_path):
    env = dict(slurm_cluster)
    ckpt, prompts, sweep = tmp_path / "ckpt", tmp_path / "prompts.jsonl", tmp_path / "sweep"
    make_hf_llama(str(ckpt), seed=1)
    write_prompts(str(prompts))
    (tmp_path / "sweep_rewards.py").write_text(REWARD)  # a reward module the jobs import (PYTHONPATH)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    out = subprocess.run([TRAIN, "-m", "hydra/launcher=slurm_cpu", f"hydra.launcher.job_name=megaft-test-{os.getpid()}",
                          f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=5", "device=cpu", "parallel.tp=1",
                          "parallel.dp=2",
                          f"model.init_from={ckpt}", "data.seq_len=16", "train.objective=grpo", f"rl.prompts={prompts}",
                          "rl.reward=['sweep_rewards:letters']", "rl.num_generations=4", "rl.max_completion_length=8",
                          "rl.loss_type=dapo,dr_grpo", "train.global_batch_size=8", "train.micro_batch_size=2",
                          "train.max_steps=2", "train.progress=false", "train.eval_every=1000", "optim.lr=1e-2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    points = json.loads((sweep / "submitted.json").read_text())["points"]
    assert [p["status"] for p in points] == ["submitted", "submitted"]
    jobs = [p["job_id"] for p in points]
    deadline = time.monotonic() + 300
    while queued(env, jobs):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *{j.split("_")[0] for j in jobs}], env=env, check=False)
            pytest.fail(f"jobs {jobs} still queued after 300 s (cancelled)")
        time.sleep(1)
    groups, lines = [], []
    for point in points:
        assert job_fields(env, point["job_id"])["JobState"] == "COMPLETED", point
        with open(os.path.join(point["run_dir"], "rollouts.jsonl")) as f:
            groups.append([json.loads(line) for line in f])
        with open(os.path.join(point["run_dir"], "metrics.jsonl")) as f:
            lines.append([r for r in map(json.loads, f) if "loss" in r])
    assert [len(g) for g in groups] == [4, 4]  # 2 steps of 2 prompts, each point
    assert groups[0][:2] == groups[1][:2]  # step 1: the same weights, the same seeded draws
    assert [len(line) for line in lines] == [2, 2] and all(r["reward_std"] > 0 for line in lines for r in line)
    assert lines[0][0]["loss"] != lines[1][0]["loss"]  # dapo and dr_grpo average the same tokens differently
