"""Context parallelism equals one process (issue 13, part 2): the loss at every step of
cp=2, cp=4, cp=2 x tp=2 with sequence parallel, cp=2 x pp=2 and cp=2 x dp=2 with ZeRO-1/2/3,
each with and without recompute, and cp=2 on document-packed rows; every first-step
gradient at cp=2 x tp=2; checkpoints resumed across a change of cp; the bytes a block
saves for backward halve at cp=2 and match the memory estimate. Two spawns (2 and 4
ranks) train every layout."""
import glob
import json
import os

import pytest
import torch
from cp_cases import CP2_RUNS, RANK4_RUNS, STEPS, cp_config, reference_of, run, train_cp_runs, train_references
from multirank import spawn
from train_cases import read_metrics, read_rows

from benchmarks.memory import estimated_block_bytes, measure_layouts, parse_key
from benchmarks.memory import key as layout_key
from megaft.checkpoint import io
from megaft.parallel.context.layout import chunk_index
from megaft.parallel.grid import ParallelGrid
from megaft.perf.memory import estimate_memory
from megaft.validation import validate

RTOL = 1e-5  # fp32: cp reorders the softmax's sums (the ring merges partial results)
# The grad norm (a sum of squares over every parameter) drifts further by step 8 of training:
# 2.1e-5 on one AMD EPYC host, within 1e-5 on another (MKL picks its kernels by CPU model);
# the losses and eval losses above stay within RTOL on both.
NORM_RTOL = 5e-5
ALL_RUNS = {**CP2_RUNS, **RANK4_RUNS}
CP_RUNS = {n: s for n, s in ALL_RUNS.items() if s.get("cp", 1) > 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cp"))
    train_references(root)
    spawn(2, train_cp_runs, root, CP2_RUNS, True)
    spawn(4, train_cp_runs, root, RANK4_RUNS, True)
    run("ref_from_cp2", {"resume_from": "cp2"}, root, ParallelGrid.single())  # cp=2's checkpoint at cp=1
    run("ref_from_cp2_tp2", {"resume_from": "cp2_tp2_sp"}, root, ParallelGrid.single())  # cp and tp both to 1
    return root


@pytest.mark.parametrize("name", [n for n, s in CP_RUNS.items() if not s.get("resume_from")])
def test_loss_curve_matches_single_process(runs, name):
    spec = CP_RUNS[name]
    want, want_eval = read_metrics(os.path.join(runs, reference_of(spec)))
    got, got_eval = read_metrics(os.path.join(runs, name))
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g == pytest.approx(w, rel=RTOL), f"{name} step {step}: {g} vs {w}"
    # tp=2 alone moves the grad norm by ~2e-5 by step 8 (matmul splits): tp runs compare with tp=2 sp without cp
    norm_ref = "tp2_sp" if spec.get("tp", 1) == 2 else reference_of(spec)
    want_norm = [r["grad_norm"] for r in read_rows(os.path.join(runs, norm_ref)) if "grad_norm" in r]
    got_norm = [r["grad_norm"] for r in read_rows(os.path.join(runs, name)) if "grad_norm" in r]
    assert got_norm == pytest.approx(want_norm, rel=NORM_RTOL), name
    for g, w in zip(got_eval, want_eval):  # eval runs whole rows on every cp rank
        assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=RTOL), name
    summary = json.load(open(os.path.join(runs, name, "summary.json")))
    assert summary["attention"] == "ring"
    assert summary["cp"] == spec["cp"] and summary["world_size"] == spec["cp"] * spec.get("tp", 1) * \
        spec.get("pp", 1) * spec.get("dp", 1)


def test_docs_runs_differ_from_stream_runs(runs):
    """The document-packed reference is another curve: cp2_docs' equality is not vacuous."""
    assert read_metrics(os.path.join(runs, "ref_docs"))[0] != pytest.approx(read_metrics(os.path.join(runs, "ref"))[0],
                                                                            rel=1e-3)


def _grads(run_dir: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "grads_*.pt"))):
        for key, grad in torch.load(path).items():
            if key in merged:  # every cp (and tp) replica holds the same reduced gradient
                assert torch.equal(merged[key], grad), f"{run_dir}: replicas of {key} differ"
            merged[key] = grad
    return merged


@pytest.mark.parametrize("name", ["cp2_tp2_sp", "cp2", "cp4", "cp2_docs"])
def test_first_step_grads_match_single_process(runs, name):
    got, want = _grads(os.path.join(runs, name)), _grads(os.path.join(runs, reference_of(CP_RUNS[name])))
    assert sorted(got) == sorted(want) and len(want) > 10, name
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=1e-8, msg=lambda m: f"{name} {key}: {m}")
    if name == "cp2_tp2_sp":  # and the tp=2 sp run without cp (same tp rounding) just as closely
        same_tp = _grads(os.path.join(runs, "tp2_sp"))
        for key in same_tp:
            torch.testing.assert_close(got[key], same_tp[key], rtol=RTOL, atol=1e-8)


@pytest.mark.parametrize("name, source", [("cp2_from_ref", "ref"), ("ref_from_cp2", "cp2"),
                                          ("ref_from_cp2_tp2", "cp2_tp2_sp")])
def test_checkpoint_resumes_across_a_change_of_cp(runs, name, source):
    """Step 5's checkpoint of one cp resumed at the other (with tp=2 to 1 as well): steps 6-10
    equal the uninterrupted run."""
    manifest = io.read_manifest(io.step_dir(os.path.join(runs, source, "checkpoints"), 5))
    assert manifest["layout"].get("cp", 1) == (1 if source == "ref" else 2)
    assert manifest["layout"]["tp"] == CP_RUNS.get(source, {}).get("tp", 1)
    got, _ = read_metrics(os.path.join(runs, name))
    want, _ = read_metrics(os.path.join(runs, source))
    assert len(got) == len(want) == STEPS
    assert got[:5] == want[:5]  # the copied lines of the run before its checkpoint
    assert got[5:] == pytest.approx(want[5:], rel=RTOL)
    ref, _ = read_metrics(os.path.join(runs, "ref"))
    assert got == pytest.approx(ref, rel=RTOL)


def _measured(runs: str) -> dict:
    out = measure_layouts(0, 1)  # tp=1 cp=1, here
    for path in glob.glob(os.path.join(runs, "saved_bytes_*.json")):
        out.update(json.load(open(path)))
    return out


def test_saved_bytes_halve_at_cp2_and_match_the_estimate(runs):
    measured = _measured(runs)
    saved = {k: v for k, v in measured.items() if not k.startswith("ring_")}
    assert len(saved) == 3 * 6  # none/selective/full x (tp1, tp2 sp0, tp2 sp1) x (cp1, cp2)
    for name, got in saved.items():
        tp, sp, cp, mode = parse_key(name)
        estimated = estimated_block_bytes(tp, sp, cp, mode)
        assert got == pytest.approx(estimated, rel=0.02), (name, got, estimated)  # the issue asks 10%
        if cp == 2:  # half the tokens: half the bytes (the ring's log-sum-exp is ~1% of them)
            assert got == pytest.approx(saved[layout_key(tp, sp, 1, mode)] / 2, rel=0.05), name
    for tp, sp in ((1, False), (2, False), (2, True)):  # recompute cuts them as the estimate says
        at = {mode: saved[layout_key(tp, sp, 2, mode)] for mode in ("none", "selective", "full")}
        est = {mode: estimated_block_bytes(tp, sp, 2, mode) for mode in at}
        for mode in ("selective", "full"):
            assert at[mode] / at["none"] == pytest.approx(est[mode] / est["none"], rel=0.05), (tp, sp, mode)


def test_ring_traffic_equals_the_formula(runs):
    """Bytes each rank sent around the ring in one forward + backward, counted at the send."""
    ring = {k: v for k, v in _measured(runs).items() if k.startswith("ring_")}
    assert sorted(ring) == sorted(f"ring_{layout_key(tp, False, 2, m)}" for tp in (1, 2) for m in ("none", "selective",
                                                                                              "full"))
    for name, (sent, formula) in ring.items():
        assert sent == formula > 0, name
    assert ring["ring_tp1_sp0_cp2_full"][0] > ring["ring_tp1_sp0_cp2_none"][0]  # the recomputed forward sends again


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_sdpa_on_whole_rows(runs, world):
    """Output and dq/dk/dv of every rank's chunks against SDPA on the whole rows, for plain
    causal blocks (the flash kernel), sliding windows and packed documents (explicit form)."""
    errors = json.load(open(os.path.join(runs, f"ring_errors_{world}.json")))
    assert sorted(errors) == ["causal", "causal_bf16", "docs", "docs_window", "window"]
    for name, errs in errors.items():
        tol = 3e-2 if name.endswith("bf16") else 1e-5
        assert max(errs) < tol, (name, errs)


def test_chunks_are_load_balanced():
    """Rank i holds chunks i and 2cp-1-i: every rank holds the same number of causal
    (query, key) pairs, and the ranks' chunks cover the sequence once."""
    seq, cp = 64, 4
    held = [chunk_index(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    pairs = [int((idx + 1).sum()) for idx in held]  # query i sees i + 1 keys
    assert len(set(pairs)) == 1, pairs


def test_cp_config_errors_and_estimate():
    cfg = cp_config(cp=2)
    cfg.launcher.nproc = 2
    assert validate(cfg, 2) == []
    cfg.data.seq_len = 30
    assert any("2*cp=4 equal chunks" in p and "multiple of 4" in p for p in validate(cfg, 2))
    cfg = cp_config(cp=2, tp=2, sequence_parallel=True)
    cfg.data.seq_len = 36  # 36 / 2 = 18 per rank: 2*cp divides, tp=2 divides 18: fine
    assert validate(cfg, 4) == []
    cfg.data.seq_len, cfg.parallel.tp = 36, 4  # 18 tokens per rank over tp=4
    problems = validate(cfg, 8)
    assert any("parallel.tp=4 does not divide" in p and "multiple of 8" in p for p in problems), problems
    cfg = cp_config(cp=2)
    assert any("world size 3 != tp*pp*dp*cp = 1*1*1*2" in p for p in validate(cfg, 3))
    # the estimate: cp=2 holds half the activations; ZeRO shards over dp x cp
    one, two = cp_config(zero=1), cp_config(cp=2, zero=1)
    a, b = estimate_memory(one, 1), estimate_memory(two, 2)
    assert b.optimizer == a.optimizer // 2
    assert b.activations < 0.55 * a.activations


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cp2_at_half_precision_equals_the_single_process_at_it(tmp_path, precision):
    """bf16 or fp16 autocast (fp16 with its dynamic loss scale) on both sides, at megaft-verify's
    tolerances for that precision: the ring merges half-precision blocks in fp32 (log-sum-exp),
    and with selective recompute of the first block only (recompute_layers=1), so cp=2 stays
    far inside them."""
    from models.layout_runs import verify  # megaft-verify, its layout on the pooled ranks

    cfg = cp_config(cp=2, recompute="selective")
    cfg.model.recompute_layers = 1
    cfg.launcher.nproc, cfg.verify.steps, cfg.verify.precision = 2, 5, precision
    report = verify(cfg, str(tmp_path))
    print(report.format())  # docs/parallelism-context.md's figures: pytest -s -k half_precision
    assert report.passed, report.format()
    assert max(r.loss_rel for r in report.rows) <= 1e-3, report.format()
