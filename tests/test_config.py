"""Bad input is a clear error raised before any rank starts, listing every problem."""
import json
import os
import subprocess
import sys

import pytest
from train_cases import small_config

from megaft.config import Config
from megaft.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_valid_default_has_no_problems():
    assert validate(Config(), 2) == []


def test_tp_that_does_not_divide_heads():
    cfg = Config()
    cfg.parallel.tp, cfg.launcher.nproc = 3, 3
    problems = validate(cfg, 3)
    assert any("parallel.tp=3 does not divide model.n_heads=4" in p for p in problems), problems


def test_world_size_mismatch_and_bad_degree_reported_together():
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.dp = 2, 2
    cfg.optim.fused = "gpu"
    problems = validate(cfg, 2)
    assert any("world size 2 != tp*pp*dp = 2*1*2" in p for p in problems), problems
    assert any("optim.fused='gpu'" in p for p in problems), problems
    cfg.parallel.tp = 0
    assert any("parallel.tp=0 must be >= 1" in p for p in validate(cfg, 2))


def test_batch_arithmetic():
    cfg = Config()
    cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.parallel.tp, cfg.parallel.dp = 10, 4, 1, 2
    problems = validate(cfg, 2)
    assert any("global_batch_size=10 is not a multiple of train.micro_batch_size * dp = 4 * 2" in p
               for p in problems), problems


def test_missing_checkpoint_files(tmp_path):
    cfg = Config()
    cfg.model.init_from = str(tmp_path)
    problems = validate(cfg, 2)
    assert any(f"{tmp_path}/config.json is missing" in p for p in problems), problems
    assert any("neither model.safetensors nor model.safetensors.index.json" in p for p in problems), problems
    cfg.model.init_from = str(tmp_path / "nope")
    assert any("is not a directory" in p for p in validate(cfg, 2))


def test_malformed_jsonl_line_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=" "completion": "4"}\n')
    cfg = Config()
    cfg.data.path = str(path)
    problems = validate(cfg, 2)
    assert any(f"{path}:2" in p for p in problems), problems


def _cli(tmp_path, *overrides):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "megaft.train", f"hydra.run.dir={tmp_path}/run", "train.progress=false",
           *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_cli_reports_every_problem_and_starts_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    out = _cli(tmp_path, "parallel.tp=3", f"data.path={bad}", "data.tokenizer=/no/such/tokenizer.json")
    assert out.returncode == 2, out.stderr
    assert "parallel.tp=3 does not divide model.n_heads=4" in out.stderr and "3*1*1" in out.stderr
    assert f"{bad}:2" in out.stderr and "/no/such/tokenizer.json" in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no rank started


def test_cli_trains_on_two_local_ranks(tmp_path):
    """The entry point end to end: local launcher, 2 gloo ranks, tp=2, run directory contract."""
    out = _cli(tmp_path, "model.dim=64", "model.n_layers=1", "data.task_train_size=500",
               "data.task_eval_size=16", "train.max_steps=3", "train.eval_every=2", "data.seq_len=32")
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert set(train[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
    assert [r["step"] for r in evals] == [0, 2, 3] and "eval_accuracy" in evals[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tp"] == 2 and summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["final_loss"] == pytest.approx(train[-1]["loss"])


def test_max_steps_zero_only_evaluates(tmp_path):
    os.makedirs(tmp_path, exist_ok=True)
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer

    cfg = small_config(steps=0)
    summary = Trainer(cfg, ParallelGrid.single(), str(tmp_path)).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 0 and "eval_loss" in rows[0]
    assert summary["final_loss"] is None and summary["eval_loss"] == pytest.approx(rows[0]["eval_loss"])


def test_torchrun_runs_the_same_entry_point(tmp_path):
    """Under torchrun each process is one rank (RANK/WORLD_SIZE from its env)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megaft.train", f"hydra.run.dir={tmp_path}/run", "train.progress=false", "model.dim=64",
           "model.n_layers=1", "data.task_train_size=500", "data.task_eval_size=16", "train.max_steps=2",
           "data.seq_len=32", "launcher.nproc=1"]  # nproc is ignored: torchrun decides the world
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tp"] == 2


def test_explicit_unavailable_adamw_kernel_is_a_config_error():
    from megaft.kernels import _ext

    cfg = Config()
    cfg.optim.fused = "cuda"
    problems = validate(cfg, 2)
    if _ext.CUDA.available:
        assert not any("optim.fused" in p for p in problems)
    else:
        assert any("optim.fused=cuda: megaft._cuda is not available" in p for p in problems), problems


def test_checks_are_pure_and_resolve_is_the_one_step_with_an_effect():
    import copy

    from megaft.validation import check_resolved, check_settings, resolve

    cfg = Config()
    cfg.parallel.tp, cfg.launcher.nproc = 1, 1
    before = copy.deepcopy(cfg)
    assert check_settings(cfg, 1) == [] and cfg == before  # values as written: nothing changes
    assert cfg.model.vocab_size == 0
    resolve(cfg)  # fills the vocabulary from the tokenizer
    assert cfg.model.vocab_size > 0 and cfg != before
    resolved = copy.deepcopy(cfg)
    assert check_resolved(cfg, 1) == [] and cfg == resolved
    cfg.parallel.tp = 3  # a layout problem is reported without touching the config
    assert any("parallel.tp=3" in p for p in check_resolved(cfg, 3)) and cfg.model == resolved.model


def _enum_fields(cls, prefix=""):
    """(dotted key, Enum type) of every field of the config dataclass `cls`, recursively."""
    import dataclasses
    import enum
    import typing

    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        for t in args:
            if dataclasses.is_dataclass(t):
                yield from _enum_fields(t, f"{prefix}{f.name}.")
            elif isinstance(t, type) and issubclass(t, enum.Enum):
                yield f"{prefix}{f.name}", t


def test_choices_are_enums_hydra_checks_by_name():
    """Fields with fixed values are enums: Hydra converts a CLI value by member NAME and the code
    compares members with strings, so each name must equal its value, and no name may hide a
    str method on the value (a member `split` would make value.split(...) fail)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from megaft.config import register_configs

    fields = dict(_enum_fields(Config))
    for key in ("precision", "model.recompute", "parallel.schedule", "parallel.offload", "data.packing",
                "data.train_on", "kernels.backend", "kernels.linear", "optim.fused", "verify.precision"):
        assert key in fields, key
    for key, enum_type in fields.items():
        for member in enum_type:
            assert member.name == member.value and member.name not in dir(str), (key, member)
    register_configs()
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = OmegaConf.to_object(compose("train", overrides=["parallel.schedule=1f1b", "model.recompute=full"]))
        assert cfg.parallel.schedule == "1f1b" and cfg.model.recompute == "full"
        with pytest.raises(ConfigCompositionException) as failed:
            compose("train", overrides=["model.recompute=partial"])
        assert isinstance(failed.value.__cause__, ValidationError)  # naming the allowed values
        assert "expected one of [none, selective, full]" in str(failed.value.__cause__)
