"""LoRA training under every parallel layout equals the single-process LoRA run (issue 15),
through megaft-verify's machinery (megaft.verify.run: loss and grad norm per step, and every
adapter's step-1 gradient by name, read back from the step-1 checkpoints): one spawned
group per layout, 10 fp32 steps on a tiny random Llama checkpoint.

* tp=2 with sequence parallel and lora.dropout=0.1: the adapter dropout masks are drawn
  whole and sliced, so the tp ranks and the single process draw the same masks;
* tp=1 pp=2 dp=2 with ZeRO-2 (world 4): dp-reduced adapter grads, sharded adapter state;
* dp=2 with ZeRO-1 (world 2): sharded Adam moments, whole adapter grads;
* tp=2 pp=2 (world 4), and pp=2 interleaved (vpp=2, a 4-layer checkpoint);
* tp=2 with sequence parallel, dropout and model.recompute=full; and single-process recompute
  selective/full against none with adapter dropout (the masks replayed);
* cp=2 (adapter dropout off: cp ranks draw their own masks, megaft-verify says so);
* tp=2 with an lm_head adapter on Qwen3 and Mistral checkpoints;
* tp=2 with sequence parallel at precision=fp16 (dynamic loss scaling) against the
  single process at fp16.
Exports (PEFT adapter and merged weights) at tp=2 and pp=2 equal the single process's.
The tp=2 and the pp=2·dp=2 ZeRO-2 runs' adapter checkpoints also resume in one process
(resharded) like the uninterrupted single process.
The ZeRO runs also measure every rank's state bytes (ShardedAdamW.memory_bytes(), recorded
by a wrapped optim builder) and check them against the formula for the rank's adapter
parameters n (fp32: params 4n, grads 4n (ZeRO-1) or 4n/dp (ZeRO-2), Adam moments 8n/dp;
frozen base: no grad, no state) and against megaft.perf.memory, validate()'s memory check.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import shutil

import pytest
import torch
from models.arch_fixture import make_hf
from models.layout_runs import Case, run_cases, verify  # megaft-verify/-train ranks from the pool
from models.layout_runs import check as check_case

from lora.lora_fixture import TARGETS, lora_config, write_data
from megaft.config import Config
from megaft.parallel.grid import ParallelGrid
from megaft.perf.memory import estimate_ranks
from megaft.training.loop import Trainer
from megaft.training.parts import RunParts, TrainSpec, build_optim
from megaft.validation import validate

# fp32: the layouts only reorder sums (~1e-7 relative); issue 15 asks for 1e-5 on the losses.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_base")
    make_hf(str(root / "ckpt"), "llama3")
    return str(root / "ckpt"), write_data(root / "train.jsonl")


def layout_config(base, *, tp: int, pp: int = 1, dp: int = 1, zero: int = 0, sp: bool = False, **lora) -> Config:
    ckpt, data = base
    cfg = Config()
    cfg.model.init_from = ckpt
    cfg.data.path, cfg.data.seq_len = data, 16
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 8
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = tp, pp, dp, zero
    cfg.parallel.sequence_parallel = sp
    cfg.launcher.nproc = tp * pp * dp
    cfg.optim.lr = 1e-2  # adapters start at B = 0: a large step makes every one of them move
    cfg.verify.steps = 10
    cfg.lora = lora_config(**lora)
    return cfg


def check(report) -> None:
    assert report.passed, report.format()
    assert [r.step for r in report.rows] == list(range(1, 11))
    assert max(r.loss_rel for r in report.rows) <= LOSS_RTOL, report.format()
    names = [n for n, _ in report.grads]
    # only adapters have gradients (and optimizer state): the checkpoints hold nothing else
    assert names and all(".adapter." in n for n in names), names


def test_tp2_sequence_parallel_with_dropout_equals_single_process(tmp_path, base):
    cfg = layout_config(base, tp=2, sp=True, dropout=0.1)
    report = verify(cfg, str(tmp_path / "verify"))
    check(report)
    names = {n for n, _ in report.grads}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert any(f"{proj}.adapter.A" in n for n in names) and any(f"{proj}.adapter.B" in n for n in names), proj
    # The tp=2 run's step-5 adapter checkpoint resumed at tp=1 (resharded: column B and row A
    # joined) continues like the uninterrupted single process (dropout masks too: its RNG state).
    resume_single_process(base, tmp_path, dropout=0.1)


def resume_single_process(base, tmp_path, **lora) -> None:
    """The verify layout run's step-5 checkpoint (in tmp_path/verify) resumed by one process:
    steps 6-10 equal the uninterrupted single-process reference."""
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "verify" / "layout" / "checkpoints" / "step_000005", run / "checkpoints" / "step_000005")
    one = layout_config(base, tp=1, **lora)
    one.train.max_steps, one.train.eval_every, one.train.progress, one.train.tensorboard = 10, 10, False, "false"
    one.kernels.backend, one.optim.fused = "torch", "torch"  # as the reference run (megaft.verify.run)
    assert validate(one, 1) == []
    Trainer(one, ParallelGrid.single(), str(run)).fit()
    got, want = losses(run), losses(tmp_path / "verify" / "reference")
    assert sorted(got) == [6, 7, 8, 9, 10]
    for step, loss in got.items():
        assert abs(loss - want[step]) <= LOSS_RTOL * abs(want[step]), (step, loss, want[step])


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def record_state(out_dir: str, parts: RunParts):
    """build_optim, recording this rank's measured state bytes, its adapter parameters and
    megaft.perf.memory's figures for its pp rank in out_dir/rank_<rank>.json (a layout rank's
    TrainSpec.optim: runs in the spawned ranks)."""
    cfg, grid, model = parts.cfg, parts.grid, parts.model
    optim = build_optim(parts)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    est = estimate_ranks(cfg, grid.world_size)[grid.pp_rank]
    record = {"rank": grid.rank, "dp": grid.dp_size, "pp_rank": grid.pp_rank, "zero": cfg.parallel.zero,
              "names": [n for n, _ in trainable], "adapters": sum(p.numel() for _, p in trainable),
              "frozen": sum(p.nbytes for p in model.parameters() if not p.requires_grad),
              "memory": optim.memory_bytes(),
              "estimate": {"params": est.params, "grads": est.grads, "optimizer": est.optimizer}}
    with open(os.path.join(out_dir, f"rank_{grid.rank}.json"), "w") as f:
        json.dump(record, f)
    return optim


def run_measured(cfg: Config, tmp_path):
    """verify with every layout rank's state bytes recorded: (report, records by rank)."""
    out = tmp_path / "state"
    out.mkdir()
    report = verify(cfg, str(tmp_path / "verify"), spec=TrainSpec(optim=functools.partial(record_state, str(out))))
    records = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(cfg.launcher.nproc)]
    return report, records


def check_state_bytes(records: list[dict], tmp_path, *, zero: int, dp: int, pp: int) -> None:
    """Every rank's measured bytes equal the formula for its adapters, and megaft.perf.memory."""
    assert sorted(r["rank"] for r in records) == list(range(len(records)))
    for r in records:
        n = r["adapters"]
        assert r["zero"] == zero and r["dp"] == dp and n > 0, r
        assert all(".adapter." in name for name in r["names"]), r["names"]  # only adapters hold state
        # adapter sizes are multiples of lora.rank=4, so no bucket needs padding to a multiple of dp=2
        want = {"params": 4 * n, "grads": 4 * n // (dp if zero >= 2 else 1), "optimizer": 8 * n // dp}
        got = {k: r["memory"][k] for k in want}
        assert got == want, (r["rank"], got, want)
        assert r["estimate"] == {"params": r["frozen"] + want["params"], "grads": want["grads"],
                                 "optimizer": want["optimizer"]}, (r["rank"], r["estimate"])
    # the dp ranks of one stage hold the same adapters (and so the same bytes)
    by_stage = {}
    for r in records:
        by_stage.setdefault(r["pp_rank"], []).append((r["adapters"], r["memory"]["optimizer"]))
    assert len(by_stage) == pp and all(len(set(v)) == 1 for v in by_stage.values()), by_stage
    # rank 0's summary.json, written after the 10 steps, reports the bytes measured at build
    with open(tmp_path / "verify" / "layout" / "summary.json") as f:
        summary = json.load(f)
    rank0 = next(r for r in records if r["rank"] == 0)
    assert {k: summary["memory_bytes"][k] for k in ("params", "grads", "optimizer")} == \
        {k: rank0["memory"][k] for k in ("params", "grads", "optimizer")}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="4 gloo ranks need at least 2 cores to finish in time")
def test_pp2_dp2_zero2_equals_single_process_and_state_bytes_equal_the_formula(tmp_path, base):
    report, records = run_measured(layout_config(base, tp=1, pp=2, dp=2, zero=2), tmp_path)
    check(report)
    check_state_bytes(records, tmp_path, zero=2, dp=2, pp=2)
    # its step-5 checkpoint (two stages, adapter moments sharded over dp) resumed by one process
    resume_single_process(base, tmp_path)


def test_dp2_zero1_equals_single_process_and_state_bytes_equal_the_formula(tmp_path, base):
    report, records = run_measured(layout_config(base, tp=1, dp=2, zero=1), tmp_path)
    check(report)
    check_state_bytes(records, tmp_path, zero=1, dp=2, pp=1)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="4 gloo ranks need at least 2 cores to finish in time")
def test_tp2_pp2_equals_single_process(tmp_path, base):
    check(verify(layout_config(base, tp=2, pp=2, rslora=True), str(tmp_path / "verify")))


def test_pp2_interleaved_equals_single_process(tmp_path, base):
    """pp=2 × vpp=2 on a 4-layer checkpoint: one block per virtual stage, adapters on each."""
    ckpt = str(tmp_path / "ckpt4")
    make_hf(ckpt, "llama3", num_hidden_layers=4)
    cfg = layout_config((ckpt, base[1]), tp=1, pp=2)
    cfg.parallel.vpp, cfg.parallel.schedule = 2, "interleaved"
    report = verify(cfg, str(tmp_path / "verify"))
    check(report)
    assert {n.split(".")[1] for n, _ in report.grads} == {"0", "1", "2", "3"}  # every layer's adapters


def test_export_at_tp2_and_pp2_equals_the_single_process_export(tmp_path, base):
    """train.export_hf with lora.export_merged after 3 steps at tp=2 (adapters gathered over tp)
    and pp=2 (collected from both stages) writes the single process's PEFT adapter and merged
    weights, to fp32 rounding of the layouts' training."""
    from safetensors.torch import load_file

    out, layouts = {}, {"single": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
    cases = []
    for name, (tp, pp) in layouts.items():
        cfg = layout_config(base, tp=tp, pp=pp, export_merged=True)
        t = cfg.train
        t.max_steps, t.eval_every, t.save_every, t.export_hf, t.progress, t.tensorboard = 3, 3, 0, True, False, "false"
        assert validate(cfg, tp * pp) == []
        run_dir = str(tmp_path / name)
        if tp * pp == 1:
            os.makedirs(run_dir)
            Trainer(cfg, ParallelGrid.single(), run_dir).fit()
        else:  # megaft-train's rank body on pooled ranks (models.layout_runs), both layouts in one spawn
            cases.append(Case(name, cfg, run_dir, verify=False))
    run_cases(str(tmp_path / "ranks"), cases)
    for name in layouts:
        if name != "single":
            check_case(str(tmp_path / "ranks"), name)  # a failed rank's traceback
        run_dir = str(tmp_path / name)
        # (pp writes the merged weights one shard per stage, with an index: read every shard)
        out[name] = {kind: {k: v for f in sorted(glob.glob(os.path.join(run_dir, kind, "*.safetensors")))
                            for k, v in load_file(f).items()} for kind in ("hf", "hf_merged")}
        out[name]["config"] = json.load(open(os.path.join(run_dir, "hf", "adapter_config.json")))
    want = out.pop("single")
    assert want["hf"] and all(k.startswith("base_model.model.") for k in want["hf"])
    for name, got in out.items():
        assert got["config"] == want["config"], name
        for kind in ("hf", "hf_merged"):
            assert set(got[kind]) == set(want[kind]), (name, kind)
            for key, tensor in want[kind].items():
                torch.testing.assert_close(got[kind][key], tensor, rtol=1e-5, atol=1e-6, msg=f"{name} {kind} {key}")


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_tp2_with_an_lm_head_adapter_on_other_families_equals_single_process(tmp_path, base, family):
    """The head's adapter (vocabulary-parallel B, padded vocabulary) trained at tp=2 on a Qwen3
    (qk-norm, head_dim 24) and a Mistral (window) checkpoint."""
    ckpt = str(tmp_path / "ckpt")
    make_hf(ckpt, family)
    report = verify(layout_config((ckpt, base[1]), tp=2, targets=[*TARGETS, "lm_head"]),
                        str(tmp_path / "verify"))
    check(report)
    names = {n for n, _ in report.grads}
    assert {"lm_head.adapter.A", "lm_head.adapter.B"} <= names, sorted(names)


def test_cp2_equals_single_process_with_adapter_dropout_off(tmp_path, base):
    """cp=2: adapters on the zig-zag chunks, their grads reduced over the dp×cp replica group.
    Each cp rank draws its own adapter dropout masks (megaft.training.loop.dropout_seed), so
    megaft-verify turns lora.dropout off on both sides and says so."""
    cfg = layout_config(base, tp=1, dropout=0.1)
    cfg.parallel.cp, cfg.launcher.nproc = 2, 2
    report = verify(cfg, str(tmp_path / "verify"))
    check(report)
    assert report.notes == [n for n in report.notes if n.startswith("lora.dropout=0.1 set to 0 on both sides: at cp=2")]
    assert len(report.notes) == 1


def test_recompute_replays_adapter_dropout_and_tp2_sp_full_recompute_equals_single_process(tmp_path, base):
    """lora.dropout=0.1 with model.recompute=selective and full: the recomputed forward draws the
    same adapter dropout masks (RNG state replayed), so 10 single-process steps give
    recompute=none's losses within fp32 rounding; and tp=2 with sequence parallel and full
    recompute equals the single process (megaft-verify)."""
    curves = {}
    for mode in ("none", "selective", "full"):
        one = layout_config(base, tp=1, dropout=0.1)
        one.model.recompute = mode
        one.train.max_steps, one.train.eval_every, one.train.progress, one.train.tensorboard = 10, 10, False, "false"
        assert validate(one, 1) == []
        (tmp_path / mode).mkdir()
        Trainer(one, ParallelGrid.single(), str(tmp_path / mode)).fit()
        curves[mode] = losses(tmp_path / mode)
    assert sorted(curves["none"]) == list(range(1, 11))
    for mode in ("selective", "full"):
        for step, loss in curves["none"].items():
            assert abs(curves[mode][step] - loss) <= 1e-6 * abs(loss), (mode, step, curves[mode][step], loss)
    cfg = layout_config(base, tp=2, sp=True, dropout=0.1)
    cfg.model.recompute = "full"
    check(verify(cfg, str(tmp_path / "verify")))


def test_fp16_with_loss_scaling_tp2_sp_equals_single_process_at_fp16(tmp_path, base):
    """fp16 autocast and the dynamic loss scale on both sides: the layout rounds in other places
    than the single process, so the comparison is at fp16's tolerances (megaft.config.verify);
    measured here: loss within 1.2e-4, step-1 adapter grads within 1.6e-3."""
    cfg = layout_config(base, tp=2, sp=True)
    cfg.precision = cfg.verify.precision = "fp16"
    report = verify(cfg, str(tmp_path / "verify"))
    print(report.format())  # docs/lora.md's figures: pytest -s -k fp16
    assert report.passed, report.format()
    assert [r.step for r in report.rows] == list(range(1, 11)) and max(r.loss_rel for r in report.rows) <= 1e-3
    assert report.rows[-1].loss < 0.8 * report.rows[0].loss, report.format()  # the scaled steps were taken
