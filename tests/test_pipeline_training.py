"""Pipeline-parallel training equals one process (issue 3): the loss at every step,
every gradient at the first step, eval loss and accuracy, the HF export and greedy
generation through the pipeline."""
import glob
import json
import os

import pytest
import torch
from multirank import spawn
from pipeline_cases import (
    NEW_TOKENS,
    PP2_RUNS,
    PROMPTS,
    RANK4_RUNS,
    STEPS,
    reference_of,
    train_pipeline_runs,
    train_reference,
)
from train_cases import read_metrics, read_rows

from megaft.pipeline.partition import stage_layer_counts, stage_layers
from megaft.validation import validate

RTOL = 1e-5  # fp32; stages only move activations, so sums are reordered at most by tp


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pipeline"))
    train_reference(root)
    spawn(2, train_pipeline_runs, root, PP2_RUNS)
    spawn(4, train_pipeline_runs, root, RANK4_RUNS)
    return root


def _norm_reference(name: str, spec: dict) -> str:
    """Grad norms are compared with the pp=1 run of the same tp: tp=2 alone already moves
    the norm by ~2e-5 relative by step 8 (matmul splits), which pipelining must not add to; the
    ring overlap (its sums over ranks in ring order) is compared with its own pp=1 run."""
    if spec.get("tp_overlap") == "ring":
        return "tp2_sp_ring_pp1"
    return "tp2_pp1" if spec.get("tp", 1) == 2 else reference_of(spec)


ALL_RUNS = {**PP2_RUNS, **RANK4_RUNS}


@pytest.mark.parametrize("name", list(ALL_RUNS))
def test_loss_curve_matches_single_process(runs, name):
    ref = reference_of(ALL_RUNS[name])
    want, want_eval = read_metrics(os.path.join(runs, ref))
    got, got_eval = read_metrics(os.path.join(runs, name))
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g == pytest.approx(w, rel=RTOL), f"{name} step {step}: {g} vs {w}"
    assert [e["step"] for e in got_eval] == [e["step"] for e in want_eval]
    for g, w in zip(got_eval, want_eval):
        assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=RTOL), name
        assert g["eval_accuracy"] == w["eval_accuracy"], name  # greedy generation runs under pp too
    norm_ref = _norm_reference(name, ALL_RUNS[name])
    want_norm = [r["grad_norm"] for r in read_rows(os.path.join(runs, norm_ref)) if "grad_norm" in r]
    got_norm = [r["grad_norm"] for r in read_rows(os.path.join(runs, name)) if "grad_norm" in r]
    assert got_norm == pytest.approx(want_norm, rel=RTOL)


def _grads(run_dir: str) -> dict[str, torch.Tensor]:
    """First-step gradients of every rank of a run, merged by parameter name."""
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "grads_*.pt"))):
        for key, grad in torch.load(path).items():
            if key in merged:  # the tied embedding's copy on the last stage: must be identical
                assert torch.equal(merged[key], grad), f"{run_dir}: copies of {key} differ"
            merged[key] = grad
    return merged


@pytest.mark.parametrize("name", [n for n, s in ALL_RUNS.items() if s.get("pp", 1) > 1])
def test_first_step_grads_match_single_process(runs, name):
    spec = ALL_RUNS[name]
    got = _grads(os.path.join(runs, name))
    want = _grads(os.path.join(runs, reference_of(spec)))
    assert sorted(got) == sorted(want), name
    for key in want:
        # rtol 1e-5 as the loss; a tiny atol for entries near zero, where tp's
        # reordered sums leave ~1e-9 absolute differences.
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=1e-8, msg=lambda m: f"{name} {key}: {m}")
    if spec.get("tp", 1) == 2:  # same tp rounding: pipelining adds nothing on top
        same_tp = _grads(os.path.join(runs, "tp2_pp1"))
        for key in same_tp:
            torch.testing.assert_close(got[key], same_tp[key], rtol=RTOL, atol=1e-9)


@pytest.mark.parametrize("name", [n for n, s in ALL_RUNS.items() if s.get("export") and s.get("pp", 1) > 1])
def test_export_and_generation_under_pp(runs, name):
    """The pp export loads into a pp=1 Decoder and holds the same tensors as a pp=1 model
    would export; greedy generation through the pipeline equals pp=1 generation."""
    from pipeline_cases import pipeline_config
    from safetensors import safe_open

    from megaft.inference.generate import greedy_generate
    from megaft.models.decoder import Decoder
    from megaft.models.hf.export import export_hf
    from megaft.models.hf.load import checkpoint_files, load_hf_weights

    spec = dict(ALL_RUNS[name])
    hf_dir = os.path.join(runs, name, "hf")
    assert os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
    cfg = pipeline_config(**spec).model
    model = Decoder(cfg)
    load_hf_weights(model, hf_dir, tp_rank=0, tp_size=1)  # strict: every name, every shape
    with open(os.path.join(hf_dir, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] == bool(spec.get("tied"))
    tensors = {}
    files = checkpoint_files(hf_dir)  # the index's weight map: every file listed exists
    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                assert key not in tensors and files[key] == file, f"{key} written twice or mis-indexed"
                tensors[key] = f.get_tensor(key)
    ref_dir = os.path.join(runs, name, "hf_pp1")
    export_hf(model, cfg, ref_dir, tokenizer_json=None, tp_group=None, is_writer=True)
    ref = {}
    for file in glob.glob(os.path.join(ref_dir, "*.safetensors")):
        with safe_open(file, "pt") as f:
            ref.update({key: f.get_tensor(key) for key in f.keys()})
    assert sorted(tensors) == sorted(ref)
    for key in ref:
        assert torch.equal(tensors[key], ref[key]), key
    trained = {}  # the pp=1 run's own export after the same 10 steps (same tp: Adam amplifies tp rounding)
    with safe_open(os.path.join(runs, _norm_reference(name, spec), "hf", "model.safetensors"), "pt") as f:
        trained.update({key: f.get_tensor(key) for key in f.keys()})
    assert sorted(trained) == sorted(tensors)
    for key in trained:
        # 10 AdamW steps on grads equal to 1e-5 relative: weights agree far tighter than lr
        torch.testing.assert_close(tensors[key], trained[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    with open(os.path.join(runs, name, "generated.json")) as f:
        got = json.load(f)
    want = greedy_generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_id=None, device=torch.device("cpu"))
    assert got == want and all(len(ids) == NEW_TOKENS for ids in got)


def test_reference_learns(runs):
    losses, _ = read_metrics(os.path.join(runs, "ref"))
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("name", [n for n, s in ALL_RUNS.items() if s.get("tied")])
def test_tied_copies_stay_identical(runs, name):
    with open(os.path.join(runs, name, "tied.json")) as f:
        assert json.load(f)["copies_equal"]


def test_summary_counts_whole_model(runs):
    with open(os.path.join(runs, "ref", "summary.json")) as f:
        want = json.load(f)["params"]
    with open(os.path.join(runs, "pp4_1f1b", "summary.json")) as f:
        got = json.load(f)
    assert got["params"] == want and got["pp"] == 4


def test_partition_even_and_override():
    assert stage_layer_counts(7, 4) == [2, 2, 2, 1]
    assert [list(r) for r in stage_layers(4, 2, [3, 1])] == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="sums to 5"):
        stage_layer_counts(4, 2, [3, 2])
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layer_counts(2, 4)


def _problems(world: int, **par) -> list[str]:
    from pipeline_cases import pipeline_config

    cfg = pipeline_config(**par)
    return validate(cfg, world)


def test_pipeline_config_errors():
    assert _problems(2, pp=2, schedule="interleaved", vpp=2) == []
    assert _problems(2, pp=2, export=True) == []  # train.export_hf works under pp
    assert any("vpp=2 needs parallel.schedule=interleaved" in p for p in _problems(2, pp=2, vpp=2))
    assert _problems(4, pp=4, schedule="interleaved") == []  # m = 4 is a multiple of pp = 4
    cfg_problems = _problems(4, pp=4, schedule="interleaved", vpp=2)
    assert any("pp*vpp = 4*2" in p for p in cfg_problems), cfg_problems
    assert any("sums to 3" in p for p in _problems(2, pp=2, pp_layers=[2, 1]))
    assert any("entries" in p for p in _problems(2, pp=2, pp_layers=[1, 1, 2]))
    assert any("schedule='zb'" in p for p in _problems(2, pp=2, schedule="zb"))


def test_interleaved_microbatch_rule():
    from pipeline_cases import pipeline_config

    cfg = pipeline_config(pp=2, vpp=2, schedule="interleaved")
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 12, 4  # m = 3 micro-batches
    problems = validate(cfg, 2)
    assert any("multiple of pp=2" in p for p in problems), problems
