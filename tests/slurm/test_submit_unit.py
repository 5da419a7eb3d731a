"""The Slurm launcher's decisions without Slurm: resource shapes, grouping into one
array per shape, rendezvous ports, the preset's GPU memory budget, and invalid points
rejected before any sbatch."""
import json
import os
import shlex
import signal
import subprocess

import pytest
from test_estimate import preset_1b  # tests/ is on sys.path (rootdir conftest)

from megaft.config import Config
from megaft.launch.env import PORT_BASE, PORT_SPAN, slurm_port
from megaft.launch.submit import (
    NodeSpec,
    Shape,
    check_point,
    group_by_shape,
    point_world_size,
    preset_gpu_budget,
    resource_shape,
    sbatch_parameters,
    task_port,
    task_python,
)
from megaft.perf.hardware import GIB, GPU_MEMORY_GIB
from megaft.perf.memory import estimate_memory

from .conftest import ROOT


def point(tp=1, pp=1, dp=None, world_size=0, nodes=0) -> Config:
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = tp, pp, dp
    cfg.launcher.world_size, cfg.launcher.nodes = world_size, nodes
    return cfg


@pytest.mark.parametrize("cfg, spec, shape", [
    (point(tp=2), NodeSpec(), Shape(1, 2, 0, 1)),                                  # CPU: all ranks on one node
    (point(tp=2, pp=2, dp=2), NodeSpec(gpus_per_node=4, cpus_per_task=8), Shape(2, 4, 4, 8)),  # 8 GPUs, 4 a node
    (point(tp=1), NodeSpec(gpus_per_node=8), Shape(1, 1, 1, 1)),                   # fewer ranks than GPUs
    (point(tp=2, world_size=8), NodeSpec(tasks_per_node=4), Shape(2, 4, 0, 1)),    # launcher.world_size wins
    (point(tp=4, nodes=2), NodeSpec(gpus_per_node=8), Shape(2, 2, 2, 1)),          # launcher.nodes wins
    (point(tp=2, dp=2), NodeSpec(nodes=2), Shape(2, 2, 0, 1)),                     # the preset's nodes
])
def test_resource_shape(cfg, spec, shape):
    assert resource_shape(cfg, spec) == (shape, [])
    assert shape.world_size == point_world_size(cfg)


@pytest.mark.parametrize("cfg, spec, words", [
    (point(tp=4, nodes=3), NodeSpec(), ["4 ranks", "3 nodes", "launcher.nodes"]),
    (point(tp=8, nodes=1), NodeSpec(gpus_per_node=4), ["8 ranks per node", "gpus_per_node=4", "launcher.nodes>=2"]),
])
def test_resource_shape_problems(cfg, spec, words):
    shape, problems = resource_shape(cfg, spec)
    assert shape is None and len(problems) == 1
    assert all(w in problems[0] for w in words), problems


def test_one_group_per_shape_in_submission_order():
    spec = NodeSpec(gpus_per_node=8)
    cfgs = [point(tp=1), point(tp=2), point(tp=1, dp=2), point(tp=2, pp=1), point(tp=1, pp=2)]
    groups = group_by_shape((resource_shape(c, spec)[0], i) for i, c in enumerate(cfgs))
    assert list(groups.items()) == [(Shape(1, 1, 1, 1), [0]), (Shape(1, 2, 2, 1), [1, 2, 3, 4])]


def test_ports_of_array_tasks_differ():
    # Slurm numbers every array task with its own SLURM_JOB_ID; neighbours must not share a port.
    ports = [task_port(str(job)) for job in range(5000, 5750)]
    assert len(set(ports)) == len(ports)
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert task_port("5001") == slurm_port("5001", "0")  # what srun step 0 of that job would use


def test_invalid_points_are_reported_and_not_submitted(tmp_path):
    # Every point is invalid, so nothing reaches sbatch and no Slurm is needed.
    sweep = tmp_path / "sweep"
    out = subprocess.run(
        [os.path.join(ROOT, ".venv", "bin", "megaft-train"), "-m", "hydra/launcher=slurm_cpu", "device=cpu",
         "model.n_kv_heads=4", "parallel.tp=3,4", "launcher.nodes=1", "hydra.launcher.gpus_per_node=2",
         f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr
    assert "point #0 (device=cpu model.n_kv_heads=4 parallel.tp=3 launcher.nodes=1" in err, err
    assert "parallel.tp=3 does not divide model.n_heads=4" in err
    assert "point #1 (" in err and "4 ranks per node but hydra.launcher.gpus_per_node=2" in err
    assert "2 of 2 point(s) invalid" in err
    record = json.loads((sweep / "submitted.json").read_text())
    assert record["arrays"] == []
    assert [p["status"] for p in record["points"]] == ["invalid", "invalid"]
    assert any("n_heads" in problem for problem in record["points"][0]["problems"])
    assert not (sweep / "0").exists() and not (sweep / "1").exists()


def test_sbatch_script_of_an_array(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    preset = dict(job_name="megaft", partition="gpu", timeout_min=30, signal_delay_s=120, array_parallelism=2,
                  mem_gb=64, setup=["module load cuda"], additional_parameters={"qos": "high"})
    text = _make_sbatch_string(command="python -m submitit.core._submit x", folder=tmp_path / "%j", map_count=3,
                               **sbatch_parameters(Shape(2, 4, 4, 8), preset))
    lines = set(text.splitlines())
    for line in ("#SBATCH --array=0-2%2", "#SBATCH --job-name=megaft-n2_t4_g4_c8", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=30", "#SBATCH --mem=64GB", "#SBATCH --qos=high",
                 "#SBATCH --signal=USR1@120", "#SBATCH --requeue", "module load cuda"):  # USR1: megaft's signal
        assert line in lines, (line, text)
    cpu = _make_sbatch_string(command="x", folder=tmp_path / "%j",
                              **sbatch_parameters(Shape(1, 2, 0, 1), dict(preset, partition=None, mem_gb=0)))
    assert "gpus" not in cpu and "--mem" not in cpu and "--partition" not in cpu, cpu


def test_cuda_needs_gpus_in_the_preset():
    cfg = point(tp=2)
    cfg.device = "cuda"
    shape, problems = resource_shape(cfg, NodeSpec())
    assert shape is None and "gpus_per_node=0" in problems[0] and "device=cpu" in problems[0]


@pytest.mark.parametrize("preset, budget", [
    ({"gpu_type": "h100", "gpu_mem_gb": 0}, (int(79.1 * GIB), "hydra.launcher.gpu_type=h100: 79.1 GiB")),
    ({"gpu_type": "H200", "gpu_mem_gb": 0}, (int(139.7 * GIB), "hydra.launcher.gpu_type=H200: 139.7 GiB")),
    ({"gpu_type": "h100", "gpu_mem_gb": 20}, (20 * GIB, "hydra.launcher.gpu_mem_gb=20")),  # a MIG slice wins
    ({"gpu_type": None, "gpu_mem_gb": 40.5}, (int(40.5 * GIB), "hydra.launcher.gpu_mem_gb=40.5")),
    ({"gpu_type": None, "gpu_mem_gb": 0}, None),  # CPU presets: no budget
    ({}, None),
])
def test_preset_gpu_budget(preset, budget):
    assert preset_gpu_budget(preset) == (budget, [])


def test_unknown_gpu_type_lists_the_known_ones():
    budget, problems = preset_gpu_budget({"gpu_type": "h1000", "gpu_mem_gb": 0})
    assert budget is None and len(problems) == 1
    assert "hydra.launcher.gpu_type='h1000' is unknown" in problems[0] and "hydra.launcher.gpu_mem_gb" in problems[0]
    assert all(name in problems[0] for name in GPU_MEMORY_GIB), problems
    assert preset_gpu_budget({"gpu_type": None, "gpu_mem_gb": -1})[1], "a negative budget is a problem"


def test_preset_budget_checks_each_point():
    """The 1b preset at tp=1 needs ~41 GiB: over an A100-40GB, under an A100-80GB. The submitting
    process sees no GPU, so without the preset's budget nothing would be checked."""
    spec = NodeSpec(gpus_per_node=8)
    a100_40, _ = preset_gpu_budget({"gpu_type": "a100-40g"})
    a100_80, _ = preset_gpu_budget({"gpu_type": "a100-80g"})

    def big(tp=1, device="auto", gpu_mem_gb=0.0):
        cfg = preset_1b()
        cfg.parallel.tp, cfg.parallel.dp, cfg.device, cfg.launcher.gpu_mem_gb = tp, None, device, gpu_mem_gb
        return cfg

    need = estimate_memory(big(), 1).total / GIB
    assert 39.3 < need < 79.1, need
    assert check_point(big(), spec, None) == (Shape(1, 1, 1, 1), [])  # no budget known: not checked
    shape, problems = check_point(big(), spec, a100_40)
    assert shape == Shape(1, 1, 1, 1) and len(problems) == 1, problems
    assert f"estimated memory per GPU {need:.1f} GiB" in problems[0]
    assert "> 39.3 GiB (hydra.launcher.gpu_type=a100-40g: 39.3 GiB)" in problems[0]
    assert "fix: raise parallel.tp=1" in problems[0] and "parallel.zero=0" in problems[0]
    assert check_point(big(), spec, a100_80) == (Shape(1, 1, 1, 1), [])  # fits the bigger GPU
    assert check_point(big(tp=2), spec, a100_40) == (Shape(1, 2, 2, 1), [])  # tp=2 halves it: fits
    # The point's own launcher.gpu_mem_gb wins over the preset, either way.
    assert check_point(big(gpu_mem_gb=80), spec, a100_40) == (Shape(1, 1, 1, 1), [])
    _, problems = check_point(big(tp=2, gpu_mem_gb=8), spec, a100_80)
    assert len(problems) == 1 and "> 8.0 GiB (launcher.gpu_mem_gb=8)" in problems[0], problems
    # Points that do not run on the preset's GPUs are not held to them.
    assert check_point(big(device="cpu"), spec, a100_40) == (Shape(1, 1, 1, 1), [])
    assert check_point(big(), NodeSpec(), a100_40) == (Shape(1, 1, 0, 1), [])


def test_oversized_points_of_a_gpu_sweep_are_rejected_before_sbatch(tmp_path):
    # The GPU preset from a machine without GPUs: point 0 is held to the preset's gpu_type,
    # point 1 to its own launcher.gpu_mem_gb. Both are invalid, so nothing reaches sbatch.
    sweep = tmp_path / "sweep"
    out = subprocess.run(
        [os.path.join(ROOT, ".venv", "bin", "megaft-train"), "-m", "hydra/launcher=slurm", "hydra.launcher.gpu_type=t4",
         "model=1b", "parallel.tp=1", "launcher.gpu_mem_gb=0,8", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    record = json.loads((sweep / "submitted.json").read_text())
    assert record["arrays"] == [] and [p["status"] for p in record["points"]] == ["invalid", "invalid"]
    (first,), (second,) = (p["problems"] for p in record["points"])
    assert "estimated memory per GPU" in first and "> 14.7 GiB (hydra.launcher.gpu_type=t4: 14.7 GiB)" in first
    assert "> 8.0 GiB (launcher.gpu_mem_gb=8)" in second
    assert first in out.stderr and "2 of 2 point(s) invalid" in out.stderr


def test_submitit_checkpoint_requeues_the_same_task_until_max_requeue(monkeypatch, tmp_path):
    # submitit's USR2 handler calls checkpoint() on rank 0 when the signal comes before training.
    from megaft.launch.submit_task import SlurmRankTask

    task = SlurmRankTask(point(), str(tmp_path))
    task.cfg.launcher.max_requeue = 2
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    again = task.checkpoint()
    assert again.function is task and again.args == () and again.kwargs == {}
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert task.checkpoint() is None  # submitit then ends the job instead of requeueing it forever


def test_task_python_starts_with_the_warning_signals_blocked():
    # submitit runs `<task_python()> -u -m submitit.core._submit <folder>` through the shell.
    probe = ("import signal, sys; "
             "print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])), sys.argv[1:])")
    out = subprocess.run(f"{task_python()} -u -c {shlex.quote(probe)} a 'b c'", shell=True, capture_output=True,
                         text=True, timeout=60)
    blocked, argv = out.stdout.rsplit("] ", 1)
    assert {int(signal.SIGUSR1), int(signal.SIGUSR2)} <= set(json.loads(blocked + "]")), out
    assert argv.strip() == "['a', 'b c']", out


@pytest.mark.parametrize("where", ["dir", "store"])
def test_scoring_jobs_group_points_by_reference_fingerprint(tmp_path, where):
    """pref.scores: points sharing a fingerprint wait for one scoring job; a stored file or a
    reference-free objective needs none; the scoring config trains nothing. With
    pref.scores=store the files live in each pair store's scores/ folder."""
    from types import SimpleNamespace

    from models.hf_fixture import make_hf_llama
    from pref.pref_train_cases import pref_config, write_pairs

    from megaft.launch.score_jobs import dependency, missing_scores, scoring_config, stores_scores
    from megaft.pref.scores import scores_path

    make_hf_llama(str(tmp_path / "ckpt"), seed=1)
    write_pairs(str(tmp_path / "a.jsonl"))
    write_pairs(str(tmp_path / "b.jsonl"), seed=3)

    def point(num: int, pairs: str, beta: float = 0.1, objective: str = "dpo"):
        cfg = pref_config(str(tmp_path / "ckpt"), str(tmp_path / pairs), objective)
        cfg.pref.beta, cfg.train.then_eval = beta, True
        cfg.pref.scores = str(tmp_path / "store") if where == "dir" else "store"
        cfg.data.cache_dir = str(tmp_path / "cache")
        return SimpleNamespace(num=num, cfg=cfg)

    points = [point(0, "a.jsonl", 0.1), point(1, "a.jsonl", 0.5), point(2, "b.jsonl"),
              point(3, "a.jsonl", 0.1, "simpo")]
    assert [stores_scores(p.cfg) for p in points] == [True, True, True, False]
    missing = missing_scores(points)
    assert sorted(sorted(p.num for p in group) for group in missing.values()) == [[0, 1], [2]]
    if where == "store":  # in the cache, per pair store
        assert scores_path(points[2].cfg).startswith(str(tmp_path / "cache"))
        assert os.path.dirname(scores_path(points[0].cfg)) != os.path.dirname(scores_path(points[2].cfg))
    os.makedirs(os.path.dirname(scores_path(points[2].cfg)))
    open(scores_path(points[2].cfg), "w").close()  # b's scores are stored: nothing to run for it
    assert [[p.num for p in group] for group in missing_scores(points).values()] == [[0, 1]]
    assert dependency({0: "7", 1: "7", 2: "9"}, points[:3]) == {"dependency": "afterok:7:9"}
    assert dependency({0: "7"}, points[3:]) == {}
    scoring = scoring_config(points[0].cfg)
    assert scoring.train.max_steps == 0 and not scoring.train.then_eval and points[0].cfg.train.then_eval
    assert scores_path(scoring) == scores_path(points[0].cfg)  # it stores what the points read


def test_scoring_jobs_group_stored_teachers_by_what_the_config_names(tmp_path):
    """distill.scores with distill.top_k: points that differ in a training setting (lr, beta) share one
    scoring job; another k, another data file or no distill.scores (scored in the run) do not; the
    group is queued whether or not a file is in the folder (its name hashes the prepared corpus)."""
    from types import SimpleNamespace

    from distill.distill_cases import distill_config, write_sft
    from models.hf_fixture import make_hf_llama

    from megaft.launch.score_jobs import missing_scores, scoring_config, stores_scores

    make_hf_llama(str(tmp_path / "ckpt"), seed=1)
    make_hf_llama(str(tmp_path / "teacher"), seed=2)
    write_sft(str(tmp_path / "a.jsonl"))
    write_sft(str(tmp_path / "b.jsonl"), seed=3)

    def point(num: int, data: str = "a.jsonl", k: int = 8, lr: float = 1e-2, beta: float = 0.5, scores=True):
        cfg = distill_config(str(tmp_path / "ckpt"), str(tmp_path / "teacher"), str(tmp_path / data), beta=beta)
        cfg.optim.lr, cfg.distill.top_k = lr, k
        cfg.distill.scores = str(tmp_path / "scores") if scores else None
        return SimpleNamespace(num=num, cfg=cfg)

    points = [point(0), point(1, lr=1e-3, beta=0.9), point(2, k=4), point(3, "b.jsonl"), point(4, scores=False)]
    assert [stores_scores(p.cfg) for p in points] == [True, True, True, True, False]
    groups = missing_scores(points)
    assert sorted(sorted(p.num for p in group) for group in groups.values()) == [[0, 1], [2], [3]]
    assert all(name.startswith("teacher-topk-config-") for name in groups)
    os.makedirs(tmp_path / "scores")
    open(tmp_path / "scores" / "teacher-topk-0.safetensors", "w").close()
    assert missing_scores(points).keys() == groups.keys()
    assert scoring_config(points[0].cfg).train.max_steps == 0
