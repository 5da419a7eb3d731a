"""megaft-verify: passes on tp=2 with sequence parallel, pp=2 interleaved and dp=2 ZeRO-3,
and fails naming the parameter when one tensor-parallel gradient all-reduce is skipped.

Each case is one local launch of 2 ranks plus the single-process reference, as a user
runs it (megaft.verify.run.run_verify); the fault comes in through a TrainSpec whose
optimizer builder skips the sequence-parallel all-reduce of one norm weight's gradient.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from megaft.config import Config
from megaft.config.verify import TOLERANCES, Shrink
from megaft.training.parts import RunParts, TrainSpec, build_optim
from megaft.verify.compare import compare
from megaft.verify.run import run_verify
from megaft.verify.shrink import shrink

FAULTY = "layers.1.post_attention_layernorm.weight"


def verify_config(**parallel) -> Config:
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.max_seq_len = 32, 2, 4, 2, 64, 64
    cfg.data.task_train_size, cfg.data.task_eval_size, cfg.data.seq_len = 500, 8, 32
    t = cfg.train
    t.micro_batch_size, t.global_batch_size = 4, 8
    cfg.verify.steps = 3
    cfg.launcher.nproc = 2
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def skip_one_sp_reduce(parts: RunParts):
    """build_optim, except that the tp all-reduce of FAULTY's gradient never happens."""
    optim = build_optim(parts)
    opt, param = optim.optimizer, dict(parts.model.named_parameters())[FAULTY]
    real = opt.sync_sequence_parallel

    def sync(tp_group):
        kept = param.grad.clone()
        real(tp_group)
        param.grad.copy_(kept)  # this rank's partial sum, as if its all-reduce were skipped

    opt.sync_sequence_parallel = sync
    return optim


CASES = {
    "tp2_sp": dict(tp=2, dp=1, sequence_parallel=True),
    "pp2_interleaved": dict(pp=2, dp=1, vpp=2, schedule="interleaved"),
    "dp2_zero3": dict(dp=2, zero=3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_passes_on_the_layouts(tmp_path, name):
    cfg = verify_config(**CASES[name])
    if name == "pp2_interleaved":
        cfg.model.n_layers = 4  # pp * vpp stages of one block each
    report = run_verify(cfg, str(tmp_path))
    assert report.passed, report.format()
    assert [r.step for r in report.rows] == [1, 2, 3]
    assert all(r.loss_rel <= 1e-5 and r.grad_norm_rel <= 1e-4 for r in report.rows)
    # every parameter of the model was compared, by its full name
    assert len(report.grads) == sum(1 for _ in range(cfg.model.n_layers)) * 9 + 3
    assert report.grads[0][1] <= 1e-4


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="4 gloo ranks need at least 2 cores to finish in time")
def test_verify_passes_with_replicated_kv_heads_under_zero3(tmp_path):
    """tp=2 over one kv head (each tp rank holds a copy of it, their grads summed over tp) with
    dp=2 ZeRO-3 (every parameter, the copies included, sharded over dp and gathered per layer)."""
    cfg = verify_config(tp=2, dp=2, zero=3, sequence_parallel=True)
    cfg.model.n_kv_heads, cfg.launcher.nproc = 1, 4
    report = run_verify(cfg, str(tmp_path))
    assert report.passed, report.format()
    assert all(r.loss_rel <= 1e-5 and r.grad_norm_rel <= 1e-4 for r in report.rows), report.format()
    assert len(report.grads) == cfg.model.n_layers * 9 + 3 and report.grads[0][1] <= 1e-4


def test_verify_fails_naming_the_parameter_of_a_skipped_all_reduce(tmp_path):
    cfg = verify_config(tp=2, dp=1, sequence_parallel=True)
    report = run_verify(cfg, str(tmp_path), spec=TrainSpec(optim=skip_one_sp_reduce))
    assert not report.passed
    assert report.grads[0][0] == FAULTY and report.grads[0][1] > 1e-2, report.format()
    assert report.grads[1][1] <= 1e-4  # every other parameter still equals the reference
    assert any(FAULTY in f for f in report.failures), report.failures
    assert report.rows[0].loss_rel <= 1e-6  # step 1's loss comes before any update


def test_residual_dropout_under_sequence_parallel_equals_single_process(tmp_path):
    """model.dropout=0.1 at tp=2 with sequence parallel: each tp rank keeps its slice of the
    whole sequence's mask (megaft.layers.dropout), so the masks are the single process's; and
    megaft-verify keeps dropout on (no note)."""
    cfg = verify_config(tp=2, dp=1, sequence_parallel=True)
    cfg.model.dropout = 0.1
    report = run_verify(cfg, str(tmp_path))
    assert report.passed and not report.notes, report.format()
    assert all(r.loss_rel <= 1e-5 for r in report.rows) and report.grads[0][1] <= 1e-4


def test_verify_turns_dropout_off_where_replicas_draw_their_own_masks(tmp_path):
    cfg = verify_config(dp=2)
    cfg.model.dropout = 0.1
    report = run_verify(cfg, str(tmp_path))
    assert report.passed, report.format()
    assert len(report.notes) == 1 and report.notes[0].startswith("model.dropout=0.1 set to 0 on both sides: at dp=2")
    assert "note: model.dropout=0.1" in report.format()
    assert cfg.model.dropout == 0.1  # the user's config is left as it was


def test_dropout_streams_are_shared_by_tp_ranks_only():
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import dropout_seed

    tp, cp, dp, pp = 2, 2, 3, 2
    seeds = {}
    for rank in range(tp * cp * dp * pp):
        grid = ParallelGrid(tp_size=tp, dp_size=dp, pp_size=pp, cp_size=cp, rank=rank, device=torch.device("cpu"),
                            backend="gloo")
        seeds.setdefault(dropout_seed(5, grid), set()).add(rank // tp)
    assert len(seeds) == cp * dp * pp and all(len(r) == 1 for r in seeds.values())  # one stream per tp group
    single = ParallelGrid(tp_size=1, dp_size=1, pp_size=1, rank=0, device=torch.device("cpu"), backend="gloo")
    assert dropout_seed(5, single) == 5


def test_only_rank_0_touches_the_verify_directories_before_the_rendezvous(tmp_path, monkeypatch):
    """Under srun, a peer that made layout/ while rank 0 cleared it failed rank 0's makedirs
    (CI): rank 1 must reach run_rank (where the rendezvous waits for rank 0) having written nothing."""
    import megaft.launch.rank as rank_mod
    from megaft.launch.env import DistEnv

    seen = {}

    def fake_run_rank(cfg, run_dir, env, threads, spec=None):
        seen[env.rank] = sorted(os.listdir(tmp_path))
        return {}

    monkeypatch.setattr(rank_mod, "run_rank", fake_run_rank)
    cfg = verify_config(tp=2, dp=1, sequence_parallel=True)
    assert run_verify(cfg, str(tmp_path), env=DistEnv(1, 2, 1, "tcp://127.0.0.1:1")) is None
    assert seen[1] == []  # nothing made, nothing cleared
    (tmp_path / "layout").mkdir()
    (tmp_path / "layout" / "stale").write_text("from an earlier verification")
    monkeypatch.setattr("megaft.verify.run.run_reference", lambda ref, run_dir: None)
    compared = types.SimpleNamespace()
    monkeypatch.setattr("megaft.verify.run.compare", lambda *a: compared)
    assert run_verify(cfg, str(tmp_path), env=DistEnv(0, 2, 0, "tcp://127.0.0.1:1")) is compared
    assert seen[0] == ["layout", "reference"] and os.listdir(tmp_path / "layout") == []  # rank 0 cleared


def test_compare_flags_the_first_differing_step(tmp_path):
    def write(path, losses):
        with open(path, "w") as f:
            for i, loss in enumerate(losses, 1):
                f.write(json.dumps({"step": i, "loss": loss, "grad_norm": 1.0}) + "\n")

    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    write(a, [2.0, 1.5, 1.2])
    write(b, [2.0, 1.5 * (1 + 1e-3), 1.2])
    grads = {"w": torch.ones(3)}
    report = compare(a, b, grads, {"w": torch.ones(3)}, TOLERANCES["fp32"])
    assert not report.passed and report.failures[0].startswith("step 2 differs")
    assert compare(a, a, grads, grads, TOLERANCES["fp32"]).passed
    missing = compare(a, a, {}, grads, TOLERANCES["fp32"])
    assert missing.grads == [("w", math.inf)] and not missing.passed


def test_shrink_keeps_the_layout_constraints():
    cfg = verify_config(tp=2, pp=2, vpp=2, schedule="interleaved")
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = 4096, 32, 32, 8, 11008
    cfg.model.vocab_size = 1000
    cfg.model.make_vocab_size_divisible_by = 64
    small = shrink(cfg)
    m = small.model
    assert (m.n_layers, m.n_heads, m.kv_heads, m.head_dim, m.dim) == (4, 32, 8, 8, 256)
    assert m.ffn_dim % 2 == 0 and m.ffn_dim < 11008
    assert (m.vocab_size, m.make_vocab_size_divisible_by) == (1000, 64)
    assert cfg.model.dim == 4096  # the user's config is left as it was
    cfg.parallel.pp_layers = [1, 2, 2, 1]
    assert shrink(cfg).model.n_layers == 6
    # Gemma 3's 5 sliding : 1 full layers, shrunk to 6 and to 4 blocks: both kinds stay
    cfg.model.layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 4
    assert shrink(cfg).model.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    cfg.parallel.pp_layers = None
    assert shrink(cfg).model.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert dataclasses.replace(cfg.verify, shrink=Shrink.auto).shrink == "auto"


def test_megaft_verify_command_exits_2_on_a_bad_config_and_0_on_a_good_one(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "megaft-verify")
    if not os.path.exists(exe):
        exe = None
    cmd = [exe] if exe else [sys.executable, "-c", "from megaft.cli import verify; verify()"]
    base = [f"hydra.run.dir={tmp_path}", "parallel=single", "launcher.nproc=1", "model.n_layers=1",
            "data.task_train_size=200", "data.task_eval_size=4", "train.micro_batch_size=4",
            "train.global_batch_size=4", "verify.steps=2"]
    bad = subprocess.run(cmd + base + ["verify.steps=0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "verify.steps=0 must be >= 1" in bad.stderr, bad.stderr[-2000:]
    good = subprocess.run(cmd + base, capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert "PASS" in good.stdout
    assert json.load(open(tmp_path / "verify.json"))["passed"] is True


def test_megaft_verify_under_torchrun_passes_and_a_lossy_layout_exits_1(tmp_path):
    """docs/verify.md's torchrun command (rank 0 reports), and the command's exit status 1 on a layout
    that really differs: bf16 gradient compression at dp=2 rounds every gradient (~4e-3), far
    beyond the fp32 tolerances, and the failure names a parameter."""
    bindir = os.path.dirname(sys.executable)
    base = ["model.n_layers=2", "model.dim=32", "model.ffn_dim=64", "data.task_train_size=200", "data.task_eval_size=4",
            "data.seq_len=32", "train.micro_batch_size=4", "train.global_batch_size=8", "verify.steps=2"]
    ok = subprocess.run([os.path.join(bindir, "torchrun"), "--standalone", "--nproc-per-node", "2", "-m",
                         "megaft.verify.app", f"hydra.run.dir={tmp_path / 'tp2'}", "parallel.tp=2",
                         "parallel.sequence_parallel=true", *base], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert ok.stdout.count("PASS: the layout equals the single process") == 1  # rank 0 alone reports
    assert json.load(open(tmp_path / "tp2" / "verify.json"))["passed"] is True
    bad = subprocess.run([os.path.join(bindir, "megaft-verify"), f"hydra.run.dir={tmp_path / 'bf16'}", "parallel.tp=1",
                          "parallel.dp=2", "parallel.grad_compression=bf16", "launcher.nproc=2", *base],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert "FAIL: parameter " in bad.stdout and "differs at step 1" in bad.stdout, bad.stdout[-2000:]
    assert json.load(open(tmp_path / "bf16" / "verify.json"))["passed"] is False
